"""The bench loop: every prompt through every method in turn (interleaved, so machine drift hits
all methods alike), turn by turn, with the lossless audit against `ar` and a progress bar.

The runner knows methods only as callables from prompt ids to a `GenerationResult`; it times its
own work apart from theirs so the harness overhead can be reported (see `summary.Overhead`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from tqdm import tqdm

from dflow.bench.pld import BLOCK_SIZE as PLD_BLOCK_SIZE, generate_pld
from dflow.bench.summary import Overhead, Tally, cells
from dflow.datasets import Sample
from dflow.engine import GenerationResult, SamplingParams
from dflow.pipeline import Pipeline


@dataclass(frozen=True)
class BenchConfig:
    methods: tuple[str, ...]  # `ar` first when present: it is the audit's reference
    max_new_tokens: int
    block_size: int  # draft block of the drafter methods
    params: SamplingParams
    audit: bool  # compare every output with ar's (T = 0 only)


Method = Callable[[Pipeline, list[int], BenchConfig], GenerationResult]


def _engine(name: str) -> Method:
    def run(pipe: Pipeline, ids: list[int], cfg: BenchConfig) -> GenerationResult:
        return pipe.generate(ids, name, cfg.max_new_tokens, cfg.block_size, cfg.params)
    return run


def _pld(pipe: Pipeline, ids: list[int], cfg: BenchConfig) -> GenerationResult:
    return generate_pld(pipe.target, ids, cfg.max_new_tokens, pipe.stop_token_ids, cfg.params)


# Bench method -> how it generates. `dflow-relay-off` is `dflash` on a DFlow checkpoint (ablation).
METHODS: dict[str, Method] = {
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
        result = METHODS[method](pipe, ids, cfg)
        out.append((result, time.perf_counter() - t0))
        if i + 1 < len(sample.turns):
            messages.append({"role": "assistant", "content": pipe.decode(result.token_ids)})
    return out


def run_bench(pipe: Pipeline, datasets: dict[str, list[Sample]], cfg: BenchConfig):
    """-> (results: dataset -> method -> cell, `Overhead`). Per prompt, every method in turn."""
    t_start = time.perf_counter()
    in_calls, overhead, results = 0.0, Overhead(), {}
    running = {m: [0, 0] for m in cfg.methods if m != "ar"}  # committed tokens, rounds: the bar's tau
    bar = tqdm(total=sum(len(s) for s in datasets.values()), unit="prompt", dynamic_ncols=True)
    for name, samples in datasets.items():
        bar.set_description(name)
        tallies = {m: Tally() for m in cfg.methods}
        for sample in samples:
            first_ids = encode_turns(pipe, [{"role": "user", "content": sample.turns[0]}])
            reference = None  # ar's ids per turn
            for method in cfg.methods:
                turns = ask(pipe, method, sample, first_ids, cfg)
                for result, call_s in turns:
                    in_calls += call_s
                    overhead.add(result, call_s)
                    tallies[method].add(result)
                    if method in running:
                        running[method][0] += sum(r.committed for r in result.rounds)
                        running[method][1] += len(result.rounds)
                tallies[method].num_prompts += 1
                outputs = [result.token_ids for result, _ in turns]
                if method == "ar":
                    reference = outputs
                elif cfg.audit and reference is not None:
                    tallies[method].mismatches += sum(a != b for a, b in zip(outputs, reference))
            bar.set_postfix_str(" ".join(f"{m} tau {c / max(r, 1):.2f}" for m, (c, r) in running.items()),
                                refresh=False)
            bar.update()
        block_sizes = {m: block_size_of(m, cfg) for m in cfg.methods}
        results[name] = cells(tallies, block_sizes, audited=cfg.audit and "ar" in cfg.methods)
    bar.close()
    overhead.runner_s = time.perf_counter() - t_start - in_calls
    return results, overhead
