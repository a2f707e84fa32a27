"""Statistics helpers for distribution tests (scipy is not a dependency)."""

from __future__ import annotations

import torch


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 0.0) -> float:
    """Pearson's goodness-of-fit p-value of observed `counts` [vocab] against `probs` [vocab].

    Categories with zero expected probability are left out of the statistic; a count in one of
    them makes the observation impossible, so the p-value is 0. Categories expected fewer than
    `min_expected` times are pooled into one, where the chi-square approximation holds.
    """
    counts, probs = counts.double().flatten(), probs.double().flatten()
    possible = probs > 0
    if counts[~possible].sum() > 0:
        return 0.0
    rare = possible & (counts.sum() * probs / probs.sum() < min_expected)
    if rare.any():
        keep = possible & ~rare
        counts = torch.cat([counts[keep], counts[rare].sum()[None]])
        probs = torch.cat([probs[keep], probs[rare].sum()[None]])
        possible = probs > 0
    if possible.sum() < 2:
        return 1.0  # one category: nothing to test
    expected = counts.sum() * probs[possible] / probs[possible].sum()
    stat = ((counts[possible] - expected) ** 2 / expected).sum()
    df = torch.tensor(float(possible.sum() - 1), dtype=torch.float64)
    # Chi-square survival function: the regularized upper incomplete gamma Q(df/2, stat/2).
    return torch.special.gammaincc(df / 2, stat / 2).item()
