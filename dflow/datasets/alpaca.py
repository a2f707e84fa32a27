"""Alpaca (open-ended instructions). Not shipped offline.

Sources: a `data_file` (e.g. `alpaca_data.json`, a JSON list), or the hub (tatsu-lab/alpaca).
Fields read: `instruction` (or `prompt`, `question`), plus `input` appended after a blank line
when non-empty.
"""

from __future__ import annotations

from dflow.datasets.base import HubSplit, Record, Sample, pick_id, pick_text

NAME = "alpaca"
PACKAGED = None
HUB = HubSplit("tatsu-lab/alpaca", None, "train")


def question(record: Record) -> str:
    return pick_text(NAME, record, ("instruction", "prompt", "question"))


def to_sample(record: Record, index: int) -> Sample:
    text = question(record)
    extra = record.get("input")
    if isinstance(extra, str) and extra.strip():
        text = f"{text}\n\n{extra}"
    return Sample(pick_id(NAME, record, ("id",), index), (text,))
