"""The training rollout's round 0, teacher-forced on one stored sequence, for the held-out probes
(scripts/probe_index1.py scores its hits, scripts/eval_heldout.py compares it with the engine):
every block sees the target's context strictly before its anchor, the anchor token then masks,
and the blocks of many anchors run packed in one drafter forward."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from dflow.drafter import DFlashDrafter
from dflow.train.batching import block_positions, packed_block_mask


@torch.no_grad()
def round0_hidden(dflash: DFlashDrafter, embed: nn.Module, ids: torch.Tensor, features: torch.Tensor,
                  anchors: torch.Tensor, chunk: int = 64) -> Iterator[tuple[slice, torch.Tensor]]:
    """ids [T], the target's raw fused features [T, F], anchors [n] -> for each run of `chunk`
    anchors, (its slice of `anchors`, the drafter's hidden states [m, B-1, hidden] at block
    indices 1..B-1), in the drafter's dtype; the caller applies its head chunk by chunk."""
    B, T, dtype = dflash.cfg.block_size, len(ids), next(dflash.parameters()).dtype
    ctx_kv = dflash.context_kv(dflash.project(features[None].to(dtype)), torch.arange(T)[None])
    for i in range(0, len(anchors), chunk):
        a = anchors[i:i + chunk][None]  # [1, m]
        m = a.shape[1]
        block = torch.full((1, m, B), dflash.cfg.mask_token_id)
        block[..., 0] = ids[a]
        x = embed(block).to(dtype).view(1, m * B, -1)  # [1, m*B, hidden]
        hidden = dflash(x, block_positions(a, B).flatten(1), ctx_kv, packed_block_mask(a, T, B, causal=False))
        yield slice(i, i + m), hidden.view(m, B, -1)[:, 1:]
