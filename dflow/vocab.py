"""The target's LM head as the drafter uses it, and the optional reduced draft vocabulary
(EAGLE-3's idea; docs/DESIGN.md, "The draft vocabulary").

A reduced drafter scores only N target ids, the most frequent supervised tokens of its training
data, through those rows of the frozen head. Its map `d2t` [N] holds the target id of each draft
id 0..N-1, strictly ascending (so an argmax over the rows breaks ties as the full argmax does);
`None` is the full vocabulary. Every use of the map goes through this module: picking the ids
(`count_supervised`, `pick_draft_vocab`), reading a stored map (`read_draft_map`), the head's
rows (`draft_head`), labels target -> draft (`to_draft`, training) and logits draft -> target
(`to_target_logits`, the engine and vLLM). Outside the map the target logits are -inf: the
drafter never proposes such a token, its q is exactly 0 there, and verification is unchanged.
On disk `d2t` holds SpecForge's and vLLM's offsets instead (target id = draft id + d2t[draft id]).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from dflow.errors import DFlowError

MAP_KEY = "d2t"  # the map's key in model.safetensors


def apply_head(head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The target's LM head on hidden [..., hidden] -> logits [..., vocab], as one 2-D matmul.
    A 3-D slice such as `hidden[:, 1:]` sends CPU bf16 linear down a batched path that copies the
    whole vocab x hidden weight on every call (over 10x slower for a 49k vocabulary).
    An empty batch (no live block, e.g. a training round whose anchors all stopped) gives empty logits."""
    flat = head(hidden.reshape(-1, hidden.shape[-1]))  # [n, vocab]
    return flat.view(*hidden.shape[:-1], flat.shape[-1])


def count_supervised(examples: Iterable[tuple[torch.Tensor, torch.Tensor]], vocab_size: int) -> torch.Tensor:
    """How often each target id is a supervised token (loss mask True) of `examples`, pairs of
    (input_ids [T], loss_mask [T]) -> counts [vocab_size] long."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for i, (ids, mask) in enumerate(examples):
        labels = ids[mask.bool()].long()  # [n]
        if labels.numel() and not 0 <= int(labels.min()) <= int(labels.max()) < vocab_size:
            raise DFlowError(f"sequence {i} holds token ids outside the target's vocabulary of {vocab_size}")
        counts += torch.bincount(labels, minlength=vocab_size)
    return counts


def pick_draft_vocab(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` most frequent ids of counts [vocab] (ties: the lower id first) -> d2t [size]
    long, ascending."""
    if not 1 <= size <= counts.numel():
        raise DFlowError(f"--draft-vocab must be in 1..{counts.numel()} (the target's vocabulary), got {size}")
    order = torch.sort(counts, descending=True, stable=True).indices  # a stable sort keeps ids ascending in ties
    return order[:size].sort().values


def read_draft_map(offsets: torch.Tensor, vocab_size: int, size: int, where) -> torch.Tensor:
    """The stored map (offsets [N], see the module docstring) -> d2t [N] long target ids; DFlowError
    (one line naming `where`) unless they are `size` distinct ids in 0..vocab_size-1, ascending."""
    problem, d2t = None, None
    if offsets.dtype not in (torch.int32, torch.int64) or offsets.dim() != 1:
        problem = f"must be a 1-D integer tensor, got {offsets.dtype} of shape {list(offsets.shape)}"
    elif offsets.numel() != size:
        problem = f"holds {offsets.numel()} ids, but dflow_config.draft_vocab_size is {size}"
    else:
        d2t = offsets.long() + torch.arange(size, device=offsets.device)
        if size and not 0 <= int(d2t.min()) <= int(d2t.max()) < vocab_size:
            problem = f"holds ids outside the vocabulary 0..{vocab_size - 1}"
        elif not bool((d2t[1:] > d2t[:-1]).all()):
            problem = "must hold distinct target ids in ascending order"
    if problem:
        raise DFlowError(f"{where}: the draft vocabulary map {MAP_KEY} {problem}")
    return d2t


def to_offsets(d2t: torch.Tensor) -> torch.Tensor:
    """d2t [N] target ids -> the stored offsets [N] (target id - draft id)."""
    return d2t - torch.arange(d2t.numel(), device=d2t.device)


def draft_head(head: nn.Module, d2t: torch.Tensor | None) -> nn.Module:
    """The frozen head restricted to the draft vocabulary: a Linear with rows d2t of its weight
    (and bias) -> logits [..., N]; the head itself when d2t is None."""
    if d2t is None:
        return head
    bias = getattr(head, "bias", None)
    rows = nn.Linear(head.weight.shape[1], d2t.numel(), bias=bias is not None, device=head.weight.device,
                     dtype=head.weight.dtype).requires_grad_(False)
    with torch.no_grad():
        rows.weight.copy_(head.weight[d2t])
        if bias is not None:
            rows.bias.copy_(bias[d2t])
    return rows


def to_draft(ids: torch.Tensor, d2t: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Target ids [...] -> (draft ids [...], 0 where outside; inside the map [...] bool). With
    d2t None, the ids themselves, all inside."""
    if d2t is None:
        return ids, torch.ones_like(ids, dtype=torch.bool)
    index = torch.searchsorted(d2t, ids).clamp(max=d2t.numel() - 1)  # d2t is ascending
    inside = d2t[index] == ids
    return torch.where(inside, index, 0), inside


def to_target(ids: torch.Tensor, d2t: torch.Tensor | None) -> torch.Tensor:
    """Draft ids [...] -> target ids [...]."""
    return ids if d2t is None else d2t[ids]


def to_target_logits(logits: torch.Tensor, d2t: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """Draft logits [..., N] -> target logits [..., vocab_size], -inf outside the map (so argmax,
    top-k/top-p and softmax over them pick, keep and weigh only the map's ids)."""
    if d2t is None:
        return logits
    out = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    return out.index_copy_(-1, d2t, logits)
