"""MBPP (basic Python programming tasks), prompted with the task text as is. Not shipped offline.

Sources: a `data_file`, or the hub (google-research-datasets/mbpp, `sanitized` test split).
Fields read: `prompt` (sanitized config) or `text` (full config), else `question`; id from `task_id`.
"""

from __future__ import annotations

from dflow.datasets.base import HubSplit, Record, Sample, pick_id, pick_text

NAME = "mbpp"
PACKAGED = None
HUB = HubSplit("google-research-datasets/mbpp", "sanitized", "test")


def question(record: Record) -> str:
    return pick_text(NAME, record, ("prompt", "text", "question"))


def to_sample(record: Record, index: int) -> Sample:
    return Sample(pick_id(NAME, record, ("task_id", "id"), index), (question(record),))
