"""Every evaluation metric, defined once (docs/DESIGN.md, "Metrics"), on plain per-round records.

Input everywhere: `samples`, a sequence of samples, each a sequence of decode-round records
(prefill is not a round): `RoundStats`, which the engine and the PLD baseline fill, or a mapping
with the same fields (a journal's JSON):

| field | meaning |
|---|---|
| accepted | a, draft tokens accepted, 0..drafted |
| committed | tokens committed in the round: a+1, fewer when a stop token or max_new_tokens cut it |
| drafted | draft positions proposed (V-1); 0 for an autoregressive round |
| draft_s, relay_s, verify_s, bookkeeping_s | wall time of each stage, seconds |

Empty inputs: a mean or rate over nothing is nan; a count over nothing is 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence, Union

STAGES = ("draft", "relay", "verify", "bookkeeping")


@dataclass
class RoundStats:
    """One decode round, as every metric below reads it."""

    accepted: int  # a: drafts accepted
    committed: int  # tokens committed (a + 1 unless a stop token or max_new_tokens cut the round)
    drafted: int  # draft positions proposed (V - 1; 0 for ar)
    draft_s: float = 0.0
    relay_s: float = 0.0
    verify_s: float = 0.0
    bookkeeping_s: float = 0.0


Round = Union[RoundStats, Mapping[str, Any]]
Samples = Sequence[Sequence[Round]]


def _field(r: Round, name: str) -> Any:
    return r[name] if isinstance(r, Mapping) else getattr(r, name)


def _rounds(samples: Samples) -> list[Round]:
    return [r for sample in samples for r in sample]


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def tau(samples: Samples) -> float:
    """Global acceptance length: total committed tokens / total decode rounds (bonus included)."""
    return _mean([_field(r, "committed") for r in _rounds(samples)])


def tau_per_sample(samples: Samples) -> float:
    """Mean over samples of each sample's tau (as the DFlash benchmark reports); samples without
    decode rounds are left out."""
    return _mean([tau([sample]) for sample in samples if sample])


def mean_accepted(samples: Samples) -> float:
    """Mean accepted drafts per round: tau without the bonus token."""
    return _mean([_field(r, "accepted") for r in _rounds(samples)])


def acceptance_by_position(samples: Samples, block_size: int) -> list[float]:
    """P(d_j accepted) for j = 1..block_size-1: rounds with a >= j / rounds that drafted d_j.

    Rounds that drafted fewer positions (a block cut short near max_new_tokens) count only for
    the positions they proposed. A position no round drafted is nan.
    """
    rounds = _rounds(samples)
    rates = []
    for j in range(1, block_size):
        drafted = sum(1 for r in rounds if _field(r, "drafted") >= j)
        accepted = sum(1 for r in rounds if _field(r, "accepted") >= j)
        rates.append(accepted / drafted if drafted else math.nan)
    return rates


def accepted_histogram(samples: Samples, block_size: int) -> list[int]:
    """Number of rounds with a = 0..block_size-1 accepted drafts (autoregressive rounds count at 0)."""
    counts = [0] * block_size
    for r in _rounds(samples):
        a = _field(r, "accepted")
        if not 0 <= a < block_size:
            raise ValueError(f"accepted={a} outside 0..{block_size - 1} for block_size={block_size}")
        counts[a] += 1
    return counts


def time_split(samples: Samples) -> dict[str, float]:
    """Mean milliseconds per round of each stage (`draft`, `relay`, `verify`, `bookkeeping`) and
    their sum (`total`)."""
    rounds = _rounds(samples)
    split = {stage: 1000.0 * _mean([_field(r, f"{stage}_s") for r in rounds]) for stage in STAGES}
    split["total"] = sum(split[stage] for stage in STAGES)
    return split


def speedup(ar_decode_s: float, method_decode_s: float) -> float:
    """AR decode time / method decode time, on the same prompts in the same run (prefill excluded)."""
    return ar_decode_s / method_decode_s if method_decode_s > 0 else math.nan


def tokens_per_s(num_tokens: int, decode_s: float) -> float:
    """Decode throughput: generated tokens / decode seconds (prefill excluded)."""
    return num_tokens / decode_s if decode_s > 0 else math.nan


@dataclass(frozen=True)
class Paired:
    """Paired differences a_i - b_i (same prompt, or same training batch): their mean, its standard
    error, and how many pairs each side wins, so that a gap can be told from noise."""

    n: int
    mean: float
    se: float  # nan with fewer than 2 pairs
    wins: int  # pairs with a_i > b_i
    losses: int  # pairs with a_i < b_i


def paired(a: Sequence[float], b: Sequence[float]) -> Paired:
    if len(a) != len(b):
        raise ValueError(f"paired differences need equal lengths, got {len(a)} and {len(b)}")
    diff = [x - y for x, y in zip(a, b)]
    k, mean = len(diff), _mean(diff)
    se = math.sqrt(sum((x - mean) ** 2 for x in diff) / (k - 1) / k) if k > 1 else math.nan
    return Paired(k, mean, se, sum(x > 0 for x in diff), sum(x < 0 for x in diff))


def summarize_rounds(samples: Samples, block_size: int) -> dict[str, Any]:
    """The round-level entries of one (dataset, method) cell of the results dict."""
    return {
        "tau": tau(samples),
        "tau_per_sample": tau_per_sample(samples),
        "mean_accepted": mean_accepted(samples),
        "accept_by_position": acceptance_by_position(samples, block_size),
        "accepted_histogram": accepted_histogram(samples, block_size),
        "time_split_ms": time_split(samples),
        "num_rounds": len(_rounds(samples)),
    }
