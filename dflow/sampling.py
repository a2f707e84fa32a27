"""Lossless speculative sampling: pure functions of tensors, no model.

This module owns how draft tokens are proposed and accepted; the decode engine calls
`draw_drafts` and `accept_drafts` with one `SamplingParams` and knows nothing of the rules behind
them. Every random draw takes an explicit `torch.Generator` (on the tensors' device), so a seed
reproduces a run on a given device.

Glossary (one round, K draft tokens d_1..d_K after the anchor; docs/DESIGN.md):
- p_j: the target's distribution at block index j (it predicts the token after d_j; p_0 follows
  the anchor). q_j: the drafter's distribution that d_j was drawn from. Both come from
  `sampling_probs` with the same temperature, top-k and top-p.
- accepted (a): how many leading draft tokens are kept, 0..K.
- bonus (b): the one token the target adds after the accepted prefix, at the first mismatch. At
  T = 0 it is the target's argmax there; at T > 0 it is drawn from the residual
  norm(max(0, p_a - q_a)) after a rejection, or from p_K when all K drafts are accepted (then
  q_K = 0 and the residual is p_K itself). A round commits a + 1 tokens.

Rules: T == 0 is greedy (`greedy_accept`, no randomness). T > 0 uses rejection sampling
(`rejection_accept`, Leviathan et al. 2023), which keeps the target's distribution exactly;
`match_accept` is the DFlash reference's sample-and-match rule, kept for comparison.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

RULES = ("rejection", "match")


def validate_sampling(temperature: float, top_k: int, top_p: float) -> None:
    """Raise ValueError unless T >= 0, top_k >= 0 (0 = off) and 0 < top_p <= 1 (1 = off)."""
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0 = off), got {top_k!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p}")


@dataclass(frozen=True)
class SamplingParams:
    """How a generation draws and accepts tokens; validated once, here, then passed whole."""

    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    rule: str = "rejection"  # or "match" (the DFlash reference's sample-and-match)
    seed: int | None = None  # the generator's seed (None: torch's default state)

    def __post_init__(self):
        validate_sampling(self.temperature, self.top_k, self.top_p)
        if self.rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {self.rule!r}")


def sampling_probs(
    logits: torch.Tensor,  # [..., vocab]
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
) -> torch.Tensor:  # [..., vocab] float32, rows sum to 1
    """Temperature, then top-k (ties with the k-th logit kept), then top-p, renormalised.
    The settings are taken as valid (`SamplingParams` checks them); T = 0 has no distribution."""
    if temperature == 0:
        raise ValueError("sampling_probs needs temperature > 0; T = 0 is greedy (argmax)")
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    if top_p < 1:
        # Nucleus: keep a sorted token while the mass before it is still short of top_p,
        # i.e. the smallest prefix reaching top_p; the first token always stays.
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        keep_sorted = sorted_probs.cumsum(dim=-1) - sorted_probs < top_p
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = probs * keep
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(
    probs: torch.Tensor,  # [..., vocab]
    generator: torch.Generator | None,
) -> torch.Tensor:  # [...] long
    """One multinomial draw over the last dim for every leading index."""
    flat = probs.reshape(-1, probs.shape[-1])
    ids = torch.multinomial(flat, 1, generator=generator)
    return ids.view(probs.shape[:-1])


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """logits [..., vocab] -> [...] long: the index of the first maximum, as `argmax` picks it.
    `max(dim).indices` is the same pick (ties and NaN included; tests/test_sampling.py) and, on
    bf16 CPU logits, much cheaper than `argmax`: a decode round picks over the vocabulary twice."""
    return logits.max(dim=-1).indices


def _accept_prefix(
    draft_ids: torch.Tensor,  # [batch, K]
    target_ids: torch.Tensor,  # [batch, K+1]
) -> tuple[torch.Tensor, torch.Tensor]:  # [batch], [batch]
    """Accept while d_j == target_ids[j-1]; the bonus = target_ids at the first miss (or at K)."""
    matches = draft_ids == target_ids[:, :-1]  # [batch, K]
    accepted = matches.long().cumprod(dim=1).sum(dim=1)
    bonus = target_ids.gather(1, accepted[:, None]).squeeze(1)
    return accepted, bonus


def greedy_accept(
    draft_ids: torch.Tensor,  # [batch, K]
    target_logits: torch.Tensor,  # [batch, K+1, vocab]
) -> tuple[torch.Tensor, torch.Tensor]:  # accepted [batch], bonus [batch]
    """T = 0: accept the longest prefix matching the target argmax; the bonus = the argmax after it."""
    return _accept_prefix(draft_ids, greedy_ids(target_logits))


def rejection_accept(
    draft_ids: torch.Tensor,  # [batch, K]
    draft_probs: torch.Tensor,  # [batch, K, vocab]  q_1..q_K
    target_probs: torch.Tensor,  # [batch, K+1, vocab]  p_0..p_K
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # accepted [batch], bonus [batch]
    """Leviathan et al. 2023: the committed tokens follow the target's distribution exactly.

    Draws, in this order: K uniforms per row (all rows at once), then one bonus per row.
    """
    batch, K = draft_ids.shape
    if K == 0:
        return draft_ids.new_zeros(batch), sample(target_probs[:, 0], generator)
    rows = torch.arange(batch, device=draft_ids.device)

    # 1. Accept d_j with probability min(1, p(d_j) / q(d_j)), stopping at the first rejection.
    p_draft = target_probs[:, :K].gather(2, draft_ids[..., None]).squeeze(2)  # [batch, K]
    q_draft = draft_probs.gather(2, draft_ids[..., None]).squeeze(2)  # [batch, K]
    u = torch.rand(batch, K, generator=generator, device=draft_ids.device, dtype=p_draft.dtype)
    accepted = (u < p_draft / q_draft).long().cumprod(dim=1).sum(dim=1)  # [batch]

    # 2. The bonus, from the residual norm(max(0, p_a - q_a)) at the first rejection; after all K
    #    accepted, q_K = 0 makes the residual p_K itself.
    p_bonus = target_probs[rows, accepted]  # [batch, vocab]
    q_bonus = draft_probs[rows, accepted.clamp(max=K - 1)] * (accepted < K)[:, None]
    residual = (p_bonus - q_bonus).clamp(min=0)
    mass = residual.sum(dim=-1, keepdim=True)
    # Rounding can leave no residual mass (p <= q everywhere); fall back to p then.
    residual = torch.where(mass > 0, residual, p_bonus)
    bonus = sample(residual / residual.sum(dim=-1, keepdim=True), generator)
    return accepted, bonus


def match_accept(
    draft_ids: torch.Tensor,  # [batch, K]
    target_probs: torch.Tensor,  # [batch, K+1, vocab]
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # accepted [batch], bonus [batch]
    """DFlash reference rule: sample the target at every index, accept while the draft matches."""
    return _accept_prefix(draft_ids, sample(target_probs, generator))


def draw_drafts(
    draft_logits: torch.Tensor,  # [batch, K, vocab]
    params: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # ids [batch, K], probs [batch, K, vocab] | None
    """Propose d_1..d_K: argmax at T = 0 (probs None), else a draw from q = sampling_probs."""
    if params.temperature == 0:
        return greedy_ids(draft_logits), None
    probs = sampling_probs(draft_logits, params.temperature, params.top_k, params.top_p)
    return sample(probs, generator), probs


def accept_drafts(
    draft_ids: torch.Tensor,  # [batch, K]
    draft_probs: torch.Tensor | None,  # [batch, K, vocab] from draw_drafts; None at T = 0
    target_logits: torch.Tensor,  # [batch, K+1, vocab]
    params: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # accepted [batch], bonus [batch]
    """The engine's one entry point: T = 0 is exactly `greedy_accept`, no random draw."""
    if params.temperature == 0:
        return greedy_accept(draft_ids, target_logits)
    target_probs = sampling_probs(target_logits, params.temperature, params.top_k, params.top_p)
    if params.rule == "match":
        return match_accept(draft_ids, target_probs, generator)
    if draft_probs is None:
        # No drafts (the prefill, an `ar` round, a last round of one token): nothing needs q.
        if draft_ids.shape[1] > 0:
            raise ValueError("rule 'rejection' at temperature > 0 needs the draft probs q")
        draft_probs = target_probs[:, :0]  # [batch, 0, vocab]
    return rejection_accept(draft_ids, draft_probs, target_probs, generator)


# The same two steps with the settings spelled out (validated on the way in), for callers that hold
# no SamplingParams: the tests and scripts that drive the rules directly.

def draft_tokens(draft_logits, temperature: float, top_k: int, top_p: float, generator):
    """`draw_drafts` with the settings as arguments."""
    return draw_drafts(draft_logits, SamplingParams(temperature, top_k, top_p), generator)


def accept(draft_ids, draft_probs, target_logits, temperature: float, top_k: int, top_p: float, generator,
           rule: str = "rejection"):
    """`accept_drafts` with the settings as arguments."""
    return accept_drafts(draft_ids, draft_probs, target_logits, SamplingParams(temperature, top_k, top_p, rule),
                         generator)
