"""The bench loop: every prompt through every method in turn (interleaved, so machine drift hits
all methods alike), turn by turn, with the lossless audit against `ar` and a progress bar.

The runner knows methods only as callables from prompt ids to a `GenerationResult`; it times its
own work apart from theirs so the harness overhead can be reported (see `summary.Overhead`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping

from tqdm import tqdm

from dflow import metrics
from dflow.bench.pld import BLOCK_SIZE as PLD_BLOCK_SIZE, generate_pld
from dflow.bench.journal import Journal, Turns
from dflow.bench.summary import Overhead, Tally, cells
from dflow.datasets import Sample
from dflow.engine import GenerationResult
from dflow.pipeline import Pipeline
from dflow.sampling import SamplingParams


@dataclass(frozen=True)
class BenchConfig:
    methods: tuple[str, ...]  # `ar` first when present: it is the audit's reference
    max_new_tokens: int
    block_size: int  # draft block of the drafter methods
    params: SamplingParams
    audit: bool  # compare every output with ar's (T = 0 only)
    block_sizes: Mapping[str, int] = field(default_factory=dict)  # label -> its own draft block (--variant ...:B)

    def for_label(self, label: str) -> "BenchConfig":
        """This config as `label` runs it: its own draft block when it has one."""
        return replace(self, block_size=self.block_sizes[label]) if label in self.block_sizes else self


Method = Callable[[Pipeline, list[int], BenchConfig], GenerationResult]


def _engine(name: str) -> Method:
    def run(pipe: Pipeline, ids: list[int], cfg: BenchConfig) -> GenerationResult:
        return pipe.generate(ids, name, cfg.max_new_tokens, cfg.block_size, cfg.params)
    return run


def _pld(pipe: Pipeline, ids: list[int], cfg: BenchConfig) -> GenerationResult:
    return generate_pld(pipe.target, ids, cfg.max_new_tokens, pipe.stop_token_ids, cfg.params)


# Bench method -> how it generates: the decoding methods (dflow.proposers.METHODS), PLD, and
# `dflow-relay-off`, which is `dflash` on a DFlow checkpoint (ablation).
BENCH_METHODS: dict[str, Method] = {
    "ar": _engine("ar"),
    "dflash": _engine("dflash"),
    "dflow": _engine("dflow"),
    "dflow-relay-off": _engine("dflash"),
    "pld": _pld,
}
ENGINE_METHOD = {"dflash": "dflash", "dflow": "dflow", "dflow-relay-off": "dflash"}  # those needing the drafter


def block_size_of(method: str, cfg: BenchConfig) -> int:
    """Tokens verified per round at most: the range of the acceptance metrics."""
    return PLD_BLOCK_SIZE if method == "pld" else cfg.block_size


def encode_turns(pipe: Pipeline, messages: list[dict]) -> list[int]:
    """The chat so far as prompt ids; without a chat template, the turns joined as plain text."""
    if getattr(pipe.tokenizer, "chat_template", None):
        return pipe.encode(messages, chat=True)
    return pipe.encode("\n\n".join(m["content"] for m in messages), chat=False)


def ask(pipe: Pipeline, method: str, sample: Sample, first_ids: list[int],
        cfg: BenchConfig) -> list[tuple[GenerationResult, float]]:
    """Every turn of `sample` through `method`, each later turn asked after the method's own
    answer. -> (result, seconds in the method call) per turn."""
    messages, out = [], []
    for i, turn in enumerate(sample.turns):
        messages.append({"role": "user", "content": turn})
        ids = first_ids if i == 0 else encode_turns(pipe, messages)
        t0 = time.perf_counter()
        result = BENCH_METHODS[method](pipe, ids, cfg)
        out.append((result, time.perf_counter() - t0))
        if i + 1 < len(sample.turns):
            messages.append({"role": "assistant", "content": pipe.decode(result.token_ids)})
    return out


def _tally(done: Turns, cfg: BenchConfig, tallies: dict[str, Tally], running: dict[str, list],
           overhead: Overhead) -> None:
    """Add one prompt's generations (label -> turns) to the cells, auditing each label against ar."""
    reference = None  # ar's ids per turn
    for label in cfg.methods:
        for result, call_s in done[label]:
            overhead.add(result, call_s)
            tallies[label].add(result)
            if label in running:
                running[label].append(result.rounds)
        tallies[label].num_prompts += 1
        outputs = [result.token_ids for result, _ in done[label]]
        if label == "ar":
            reference = outputs
        elif cfg.audit and reference is not None:
            tallies[label].mismatches += sum(a != b for a, b in zip(outputs, reference))


def run_bench(pipe: Pipeline, datasets: dict[str, list[Sample]], cfg: BenchConfig,
              lineup: dict[str, tuple[str, Pipeline]] | None = None, journal: Journal | None = None,
              runs: Callable[[int], bool] | None = None):
    """-> (results: dataset -> label -> cell, `Overhead`). Per prompt, every label in turn.

    `lineup` maps each label of `cfg.methods` to (a BENCH_METHODS key, the pipeline whose drafter it uses);
    by default each label is its own method on `pipe`. With a `journal`, prompts an earlier run
    finished are replayed from it, and each newly finished prompt is appended to it. With `runs`,
    only prompts whose index it accepts are generated (a --shard's share; none for --report-only);
    the others are reported when the journal has them and left out otherwise.
    """
    lineup = lineup or {m: (m, pipe) for m in cfg.methods}
    t_start = time.perf_counter()
    in_calls, overhead, results = 0.0, Overhead(), {}
    running = {m: [] for m in cfg.methods if m != "ar"}  # every generation's rounds: the bar's tau
    todo = {name: [(i, s, journal.get(name, i, s.turns) if journal else None) for i, s in enumerate(samples)]
            for name, samples in datasets.items()}
    if runs:  # this process's share, plus what the journal already holds
        todo = {name: [t for t in items if runs(t[0]) or t[2] is not None]
                for name, items in todo.items()}
    bar = tqdm(total=sum(len(items) for items in todo.values()), unit="prompt", dynamic_ncols=True)
    try:
        for name, items in todo.items():
            if not items:  # nothing of this dataset held or run (--report-only, --shard)
                continue
            bar.set_description(name)
            tallies = {m: Tally() for m in cfg.methods}
            for index, sample, done in items:
                if done is None:
                    first_ids = encode_turns(pipe, [{"role": "user", "content": sample.turns[0]}])
                    done = {}
                    for label in cfg.methods:
                        method, label_pipe = lineup[label]
                        done[label] = ask(label_pipe, method, sample, first_ids, cfg.for_label(label))
                        in_calls += sum(call_s for _, call_s in done[label])
                    if journal:
                        journal.put(name, index, sample.turns, done)
                _tally(done, cfg, tallies, running, overhead)
                bar.set_postfix_str(" ".join(f"{m} tau {metrics.tau(r):.2f}" for m, r in running.items()),
                                    refresh=False)
                bar.update()
            block_sizes = {m: block_size_of(lineup[m][0], cfg.for_label(m)) for m in cfg.methods}
            results[name] = cells(tallies, block_sizes, audited=cfg.audit and "ar" in cfg.methods)
    finally:
        bar.close()
    overhead.runner_s = time.perf_counter() - t_start - in_calls
    return results, overhead
