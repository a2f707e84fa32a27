"""The draft positions' cross entropy through the target's frozen LM head, without ever holding
[positions, vocab] float32 logits: the head and the loss run a chunk of positions at a time, and
the gradient with respect to the hidden states is formed in the same pass (the head is frozen, so
that is the only gradient there is). `full_cross_entropy` is the plain reference it must equal.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflow.drafter import apply_head

# Positions per chunk: 128 x 49,152 float32 logits are 25 MB, small enough to be reused by the
# allocator from chunk to chunk (larger blocks are mapped and unmapped each time, which is slow).
CHUNK_POSITIONS = 128


def full_cross_entropy(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor):
    """Reference: hidden [n, hidden], labels [n] -> (cross entropy [n] float32, argmax [n]), through
    float32 logits [n, vocab] held whole."""
    logits = apply_head(head, hidden.to(head.weight.dtype)).float()  # [n, V]
    return F.cross_entropy(logits, labels, reduction="none"), logits.detach().argmax(-1)


def chunked_cross_entropy(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor,
                          chunk: int = CHUNK_POSITIONS):
    """Same values and gradient as `full_cross_entropy`, computed `chunk` positions at a time.
    hidden [n, hidden], labels [n] -> (cross entropy [n] float32, argmax [n]). The head's matmuls
    run in the autocast dtype when autocast is on (as `full_cross_entropy`'s would)."""
    if head.weight.requires_grad or (head.bias is not None and head.bias.requires_grad):
        raise ValueError("chunked_cross_entropy needs a frozen head (it forms no gradient for it)")
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else head.weight.dtype
    weight = head.weight.to(dtype)
    bias = None if head.bias is None else head.bias.to(dtype)
    return _ChunkedHeadCE.apply(hidden, weight, bias, labels, chunk)


class _ChunkedHeadCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk):
        n = hidden.shape[0]
        ce = torch.empty(n, dtype=torch.float32, device=hidden.device)
        guess = torch.empty(n, dtype=torch.long, device=hidden.device)
        grad = torch.empty(hidden.shape, dtype=weight.dtype, device=hidden.device) if ctx.needs_input_grad[0] else None
        with torch.autocast(hidden.device.type, enabled=False):
            for i in range(0, n, chunk):
                rows = slice(i, min(n, i + chunk))
                y = labels[rows]
                logits = F.linear(hidden[rows].to(weight.dtype), weight, bias).float()  # [c, V]
                lse = logits.logsumexp(-1)  # [c]
                ce[rows] = lse - logits.gather(1, y[:, None])[:, 0]
                guess[rows] = logits.argmax(-1)
                if grad is not None:  # d ce / d logits = softmax - onehot; through the head: @ W
                    probs = logits.sub_(lse[:, None]).exp_()
                    probs[torch.arange(len(y), device=y.device), y] -= 1
                    grad[rows] = probs.to(weight.dtype) @ weight
        ctx.save_for_backward(grad)
        ctx.hidden_dtype = hidden.dtype
        ctx.mark_non_differentiable(guess)
        return ce, guess

    @staticmethod
    def backward(ctx, grad_ce, _grad_guess):
        (grad,) = ctx.saved_tensors
        return (grad_ce[:, None] * grad.float()).to(ctx.hidden_dtype), None, None, None, None
