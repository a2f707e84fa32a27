"""From raw generations to report cells: per (dataset, method) tallies, the harness-overhead
figure and the Markdown sections `report.md` gets beyond the standard tables (relay ablation,
overhead). Every metric comes from `dflow.metrics`; nothing here redefines one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from dflow import metrics
from dflow.engine import GenerationResult
from dflow.metrics import RoundStats
from dflow.report import OVERALL, format_runtime_breakdown

OVERHEAD_LIMIT_PCT = 3.0


@dataclass
class Tally:
    """One (dataset, method) cell while it fills; a generation is one prompt turn."""

    rounds: list[list[RoundStats]] = field(default_factory=list)  # per generation
    prefill_s: float = 0.0
    decode_s: float = 0.0
    num_tokens: int = 0  # every new token, the prefill's included
    num_prompts: int = 0
    mismatches: int = 0  # generations whose ids differ from ar's (audit)

    def add(self, result: GenerationResult) -> None:
        self.rounds.append(result.rounds)
        self.prefill_s += result.prefill_s
        self.decode_s += result.decode_s
        self.num_tokens += len(result.token_ids)


def cells(tallies: Mapping[str, Tally], block_sizes: Mapping[str, int], audited: bool) -> dict[str, dict]:
    """results[dataset] for one dataset: method -> the cell `report.write_report` reads.

    speedup: ar's summed decode time / the method's, over the same prompts (nan without ar);
    mismatches: None when the audit is off.
    """
    ar = tallies.get("ar")
    out = {}
    for method, t in tallies.items():
        cell = metrics.summarize_rounds(t.rounds, block_sizes[method])
        decode_tokens = sum(r.committed for sample in t.rounds for r in sample)
        cell.update(
            tokens_per_s=metrics.tokens_per_s(decode_tokens, t.decode_s),
            speedup=metrics.speedup(ar.decode_s, t.decode_s) if ar else math.nan,
            mismatches=t.mismatches if audited else None,
            num_prompts=t.num_prompts,
            num_generations=len(t.rounds),
            num_tokens=t.num_tokens,
            prefill_s=t.prefill_s,
            decode_s=t.decode_s,
            block_size=block_sizes[method],
        )
        out[method] = cell
    return out


@dataclass
class Overhead:
    """Where the bench loop's wall time went, split so the harness's own share can be checked."""

    runner_s: float = 0.0  # in the bench loop outside method calls: encode, audit, stats, progress bar
    engine_untimed_s: float = 0.0  # decode time outside the four timed phases (round records, loop)
    setup_s: float = 0.0  # inside method calls but outside prefill + decode (proposer, cache, hooks)
    round_s: float = 0.0  # summed draft + relay + verify + bookkeeping of every decode round
    num_rounds: int = 0

    def add(self, result: GenerationResult, call_s: float) -> None:
        phases = sum(r.draft_s + r.relay_s + r.verify_s + r.bookkeeping_s for r in result.rounds)
        self.engine_untimed_s += result.decode_s - phases
        self.setup_s += call_s - result.prefill_s - result.decode_s
        self.round_s += phases
        self.num_rounds += len(result.rounds)

    def as_dict(self) -> dict[str, Any]:
        harness = self.runner_s + self.engine_untimed_s
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in {
            "percent_of_round_time": 100.0 * harness / self.round_s if self.round_s > 0 else math.nan,
            "limit_percent": OVERHEAD_LIMIT_PCT,
            "harness_ms_per_round": 1000.0 * harness / self.num_rounds if self.num_rounds else math.nan,
            "round_ms_mean": 1000.0 * self.round_s / self.num_rounds if self.num_rounds else math.nan,
            "runner_s": self.runner_s,
            "engine_untimed_s": self.engine_untimed_s,
            "call_setup_s": self.setup_s,
            "round_s": self.round_s,
            "num_rounds": self.num_rounds,
        }.items()}


def overhead_section(o: Mapping[str, Any]) -> str:
    pct = o["percent_of_round_time"]
    verdict = "within" if pct <= o["limit_percent"] else "OVER"
    return "\n".join([
        "## Harness overhead", "",
        f"{pct:.2f}% of round time ({o['harness_ms_per_round']:.3f} ms per round, rounds average "
        f"{o['round_ms_mean']:.2f} ms): {verdict} the {o['limit_percent']:.0f}% budget.", "",
        f"- runner outside method calls (encode, audit, stats, progress bar): {o['runner_s']:.3f} s",
        f"- decode time outside the four timed phases (round records, loop control): {o['engine_untimed_s']:.3f} s",
        f"- summed round time: {o['round_s']:.3f} s over {o['num_rounds']} rounds",
        f"- not counted, reported apart: per-call setup (proposer, cache, HF generate setup after "
        f"prefill) {o['call_setup_s']:.3f} s",
    ])


def relay_ablation_section(results: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> str:
    """The same DFlow checkpoint with relay off (mask) and on (relay), like the paper's Table 3."""
    rows = ["| dataset | Mask (relay off) tau | Relay tau | gain | speedup off | speedup on | relay ms/round |",
            "|---|---|---|---|---|---|---|"]
    for dataset, by_method in results.items():
        off, on = by_method.get("dflow-relay-off"), by_method.get("dflow")
        if off is None or on is None:
            continue
        relay_ms = on.get("time_split_ms", {}).get("relay", math.nan)
        rows.append(f"| {dataset} | {_f(off['tau'])} | {_f(on['tau'])} | {_f(on['tau'] - off['tau'], '+.2f')} | "
                    f"{_f(off['speedup'])}x | {_f(on['speedup'])}x | {_f(relay_ms, '.3f')} |")
    return "\n".join(["## Relay ablation (Table 3)", "",
                      "The same checkpoint, every draft position starting from the mask embedding (relay off) "
                      "or from the relayed verifier states (relay on).", "", *rows])


def runtime_breakdown(results: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> str:
    """The per-round cost split of the speculative methods, over all datasets (the paper's Figure 3)."""
    overall = results[OVERALL]
    return format_runtime_breakdown({m: c["time_split_ms"] for m, c in overall.items()
                                     if m != "ar" and "time_split_ms" in c})


def _f(x: float | None, spec: str = ".2f") -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:{spec}}"
