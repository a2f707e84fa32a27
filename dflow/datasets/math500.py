"""MATH-500 (500 competition math problems), prompted like GSM8K. Not shipped offline.

Sources: a `data_file`, or the hub (HuggingFaceH4/MATH-500).
Fields read: `problem` (or `question`, `prompt`); id from `unique_id` (or `id`); category from
`subject`.
"""

from __future__ import annotations

from dflow.datasets.base import HubSplit, Record, Sample, pick_id, pick_text
from dflow.datasets.gsm8k import SUFFIX

NAME = "math500"
PACKAGED = None
HUB = HubSplit("HuggingFaceH4/MATH-500", None, "test")


def question(record: Record) -> str:
    return pick_text(NAME, record, ("problem", "question", "prompt"))


def to_sample(record: Record, index: int) -> Sample:
    return Sample(
        pick_id(NAME, record, ("unique_id", "id"), index),
        (question(record) + SUFFIX,),
        record.get("subject"),
    )
