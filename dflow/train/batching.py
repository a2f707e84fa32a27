"""Batch layout for drafter training (docs/DESIGN.md, "Training"): anchors, packed-block masks,
same-position labels and the decayed loss weights.

Model-free and index-only: which positions may anchor a block, where each block sits, what it
may attend to and what it must predict. The rollout (rollout.py) runs the models on top.

Layout. A batch holds b sequences right-padded to T. Each sequence has up to n anchors (padding
anchors have `live` False and sit at position 0). The block of anchor s holds B tokens at
positions s..s+B-1; the n blocks of a sequence are packed side by side as [b, n*B]. Keys are
[context (T positions) | packed blocks (n*B)], as in the drafter's and the target's attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# DFlash's decay constants gamma for block sizes 8, 10 and 16 (loss weight exp(-(k-1)/gamma)).
GAMMA_POINTS = ((8, 4.0), (10, 5.0), (16, 7.0))


def loss_gamma(block_size: int) -> float:
    """gamma = 7 for B = 16, 5 for 10, 4 for 8; other B: piecewise linear through those three
    points, extended beyond them with the end segments' slopes (B = 2 -> 1.0, B = 32 -> 12.33)."""
    (b0, g0), (b1, g1), (b2, g2) = GAMMA_POINTS
    if block_size <= b1:
        return g0 + (block_size - b0) * (g1 - g0) / (b1 - b0)
    return g1 + (block_size - b1) * (g2 - g1) / (b2 - b1)


def loss_weights(block_size: int, gamma: float | None = None) -> torch.Tensor:
    """[B-1] weight of block index k = 1..B-1: exp(-(k-1)/gamma) (gamma: DFlash's `loss_gamma` by default)."""
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / (gamma or loss_gamma(block_size)))


def anchor_candidates(loss_mask: torch.Tensor) -> torch.Tensor:
    """loss_mask [..., T] -> bool [..., T]: position s may anchor a block when s >= 1 (a block
    needs some context), s and s+1 are supervised (so index 1 has a label)."""
    ok = torch.zeros_like(loss_mask, dtype=torch.bool)
    ok[..., 1:-1] = loss_mask[..., 1:-1] & loss_mask[..., 2:]
    return ok


def sample_anchors(loss_mask: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
    """loss_mask [T] -> up to n distinct anchor positions [m], sorted, drawn uniformly without
    replacement among `anchor_candidates`."""
    candidates = anchor_candidates(loss_mask).nonzero().flatten()  # [c]
    pick = torch.randperm(len(candidates), generator=generator)[:n]
    return candidates[pick].sort().values


@dataclass
class Batch:
    ids: torch.Tensor  # [b, T] long, right-padded with 0
    loss_mask: torch.Tensor  # [b, T] bool, False on padding
    lengths: torch.Tensor  # [b] long
    anchors: torch.Tensor  # [b, n] long, 0 where not live
    live: torch.Tensor  # [b, n] bool

    def to(self, device) -> "Batch":
        return Batch(*(t.to(device) for t in (self.ids, self.loss_mask, self.lengths, self.anchors, self.live)))

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())


def collate(sequences: list[tuple[torch.Tensor, torch.Tensor]], anchors: list[torch.Tensor]) -> Batch:
    """Pad (ids [t], loss_mask [t]) pairs and their anchor lists [m] into one Batch."""
    b = len(sequences)
    T = max(len(ids) for ids, _ in sequences)
    n = max(1, max(len(a) for a in anchors))
    batch = Batch(torch.zeros(b, T, dtype=torch.long), torch.zeros(b, T, dtype=torch.bool),
                  torch.zeros(b, dtype=torch.long), torch.zeros(b, n, dtype=torch.long),
                  torch.zeros(b, n, dtype=torch.bool))
    for i, ((ids, mask), a) in enumerate(zip(sequences, anchors)):
        batch.ids[i, : len(ids)] = ids
        batch.loss_mask[i, : len(ids)] = mask
        batch.lengths[i] = len(ids)
        batch.anchors[i, : len(a)] = a
        batch.live[i, : len(a)] = True
    return batch


def block_positions(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """anchors [b, n] -> positions [b, n, B] = s + 0..B-1."""
    return anchors[..., None] + torch.arange(block_size, device=anchors.device)


def block_labels(ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, live: torch.Tensor,
                 block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Same-position labels: index j = 1..B-1 of the block at s predicts y_{s+j}.
    -> labels [b, n, B-1] long, valid [b, n, B-1] bool (live anchor, s+j supervised and < T)."""
    T = ids.shape[1]
    pos = block_positions(anchors, block_size)[..., 1:]  # [b, n, B-1]
    inside = pos < T
    flat = pos.clamp(max=T - 1).flatten(1)  # [b, n*(B-1)]
    labels = ids.gather(1, flat).view_as(pos)
    valid = loss_mask.gather(1, flat).view_as(pos) & inside & live[..., None]
    return labels, valid


def teacher_states(teacher: torch.Tensor, anchors: torch.Tensor, live: torch.Tensor, block_size: int) -> torch.Tensor:
    """`--loss kl`'s targets: teacher [b, T, hidden] (the target's final states), anchors / live
    [b, n] -> [m * (B-1), hidden], for each live block and index j = 1..B-1 the state at s+j-1,
    where the target predicts label j (positions past the end, whose labels weigh nothing, read
    the last state)."""
    b, T, H = teacher.shape
    pos = block_positions(anchors, block_size)[..., :-1].clamp(max=T - 1)  # [b, n, B-1]
    rows = teacher.gather(1, pos.flatten(1)[..., None].expand(-1, -1, H)).view(*pos.shape, H)  # [b, n, B-1, H]
    return rows[live].flatten(0, 1)


def packed_block_mask(anchors: torch.Tensor, context_len: int, block_size: int, causal: bool) -> torch.Tensor:
    """anchors [b, n] -> bool [b, 1, n*B, T + n*B], True = visible. A query of the block at s sees
    context positions < s and its own block: all of it (drafter) or indices <= its own (`causal`,
    the target's verifier pass). Other blocks are never visible."""
    b, n = anchors.shape
    B, T, dev = block_size, context_len, anchors.device
    ctx = torch.arange(T, device=dev) < anchors[..., None]  # [b, n, T]
    ctx = ctx[:, :, None, :].expand(b, n, B, T).reshape(b, n * B, T)
    block_id = torch.arange(n * B, device=dev) // B
    own = block_id[:, None] == block_id[None, :]  # [nB, nB]
    if causal:
        own = own & torch.ones(n * B, n * B, dtype=torch.bool, device=dev).tril()
    return torch.cat([ctx, own.expand(b, -1, -1)], dim=2)[:, None]


def bias_anchor_keys(mask: torch.Tensor, context_len: int, block_size: int, bias: float) -> torch.Tensor:
    """A drafter mask (bool [..., q, context_len + n*B], True = visible; n blocks of B keys after
    the context) with `bias` added to the attention logits of each block's anchor key (block index
    0, column context_len + k*B), as an additive float mask; the mask itself when bias is 0.
    Training only (`--block-bias`): it draws a fresh drafter's draft positions to their anchor
    token, whose share of a long context's attention is otherwise too small for the gradient to
    find (scripts/probe_attention.py)."""
    if bias == 0:
        return mask
    additive = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    additive[..., context_len::block_size] = bias
    return additive.masked_fill(~mask, float("-inf"))


def block_chunks(rows: torch.Tensor, anchors: torch.Tensor, max_blocks: int) -> list[tuple[int, int, int, int]]:
    """Blocks listed sequence by sequence (rows [m] non-decreasing, anchors [m]) -> runs of at most
    `max_blocks` consecutive blocks of one sequence, as (row, start, end, context): blocks
    start..end-1, and the run's largest anchor. A block sees context positions < its anchor, so
    the run needs the first `context` positions only (tight when the anchors are sorted)."""
    rows, anchors = rows.tolist(), anchors.tolist()
    chunks, start = [], 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or rows[i] != rows[start] or i - start == max_blocks:
            chunks.append((rows[start], start, i, max(anchors[start:i])))
            start = i
    return chunks


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool mask (True = visible) -> additive float mask (0 / most negative), which HF's eager and
    SDPA attention both accept as a ready-made 4-D mask."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)

