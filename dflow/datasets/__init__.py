"""The evaluation datasets: one module per benchmark, and this registry over them.

`load_dataset(name)` turns a benchmark into `Sample`s (formatted user turns, ready for a chat
template); it raises `DatasetUnavailable` with a one-line reason when a dataset cannot be had
here (the bench runner reports it as skipped). `eval_prompt_texts()` is what the training-data
builder uses to keep evaluation prompts out of training.
"""

from __future__ import annotations

from typing import Protocol

from dflow.datasets import alpaca, gsm8k, humaneval, math500, mbpp, mt_bench
from dflow.datasets.base import (
    DatasetUnavailable,
    HubSplit,
    PackagedFile,
    Record,
    Sample,
    load_records,
    normalize_text,
    packaged_path,
    read_records,
)

__all__ = [
    "DATASETS",
    "OFFLINE_DATASETS",
    "DatasetUnavailable",
    "Sample",
    "eval_prompt_texts",
    "load_dataset",
    "normalize_text",
]


class Benchmark(Protocol):
    """What each benchmark module defines."""

    NAME: str
    PACKAGED: PackagedFile | None  # None: not shipped in any package (local file or hub only)
    HUB: HubSplit

    def question(self, record: Record) -> str: ...  # the raw first-turn text

    def to_sample(self, record: Record, index: int) -> Sample: ...


# Table 1 order of the paper: math, code, chat.
_BENCHMARKS: dict[str, Benchmark] = {m.NAME: m for m in (gsm8k, math500, humaneval, mbpp, mt_bench, alpaca)}
DATASETS: tuple[str, ...] = tuple(_BENCHMARKS)
OFFLINE_DATASETS: tuple[str, ...] = tuple(n for n, m in _BENCHMARKS.items() if m.PACKAGED is not None)


def _benchmark(name: str) -> Benchmark:
    if name not in _BENCHMARKS:
        raise ValueError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}")
    return _BENCHMARKS[name]


def load_dataset(name: str, num_prompts: int | None = None, data_file: str | None = None) -> list[Sample]:
    """The first `num_prompts` samples (all when None) of a benchmark, in file order.

    `data_file` (JSONL, JSONL.gz or a JSON list) replaces the packaged file or the hub; each
    benchmark module's docstring lists the fields it reads.
    """
    bench = _benchmark(name)
    if num_prompts is not None and num_prompts < 1:
        raise ValueError(f"num_prompts must be positive, got {num_prompts}")
    records = load_records(name, data_file, bench.PACKAGED, bench.HUB)[:num_prompts]
    return [bench.to_sample(record, i) for i, record in enumerate(records)]


def eval_prompt_texts() -> set[str]:
    """Normalised first user turns, formatted and raw, of every packaged eval dataset.

    Compare with `normalize_text(turn)`. Reads the packaged files only (never the hub); a
    package that is not installed contributes nothing.
    """
    texts: set[str] = set()
    for bench in _BENCHMARKS.values():
        path = packaged_path(bench.PACKAGED) if bench.PACKAGED is not None else None
        if path is None:
            continue
        for i, record in enumerate(read_records(bench.NAME, path)):
            texts.add(normalize_text(bench.question(record)))
            texts.add(normalize_text(bench.to_sample(record, i).turns[0]))
    return texts
