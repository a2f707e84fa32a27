"""Statistics helpers for distribution tests (scipy is not a dependency)."""

from __future__ import annotations

import torch


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's goodness-of-fit p-value of observed `counts` [vocab] against `probs` [vocab].

    Categories with zero expected probability are left out of the statistic; a count in one of
    them makes the observation impossible, so the p-value is 0.
    """
    counts, probs = counts.double(), probs.double()
    possible = probs > 0
    if counts[~possible].sum() > 0:
        return 0.0
    expected = counts.sum() * probs[possible] / probs[possible].sum()
    stat = ((counts[possible] - expected) ** 2 / expected).sum()
    df = torch.tensor(float(possible.sum() - 1), dtype=torch.float64)
    # Chi-square survival function: the regularized upper incomplete gamma Q(df/2, stat/2).
    return torch.special.gammaincc(df / 2, stat / 2).item()
