"""The draft positions' cross entropy through the target's frozen LM head, without ever holding
[positions, vocab] float32 logits: the head and the loss run a chunk of positions at a time, and
the gradient with respect to the hidden states is formed in the same pass (the head is frozen, so
that is the only gradient there is). `full_cross_entropy` is the plain reference it must equal.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from dflow.vocab import apply_head

# Positions per chunk (256 x 49,152 float32 logits: 50 MB), wide enough for efficient head matmuls.
CHUNK_POSITIONS = 256


def full_cross_entropy(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor):
    """Reference: hidden [n, hidden], labels [n] -> (cross entropy [n] float32, argmax [n]), through
    float32 logits [n, vocab] held whole."""
    logits = apply_head(head, hidden.to(head.weight.dtype)).float()  # [n, V]
    return F.cross_entropy(logits, labels, reduction="none"), logits.detach().argmax(-1)


def chunked_cross_entropy(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor,
                          chunk: int = CHUNK_POSITIONS, compiled: bool = False):
    """Same values and gradient as `full_cross_entropy`, computed `chunk` positions at a time.
    hidden [n, hidden], labels [n] -> (cross entropy [n] float32, argmax [n]). The head's matmuls
    run in the autocast dtype when autocast is on (as `full_cross_entropy`'s would). `compiled`:
    the passes over each [chunk, vocab] block fused by torch.compile (same values)."""
    if head.weight.requires_grad or (head.bias is not None and head.bias.requires_grad):
        raise ValueError("chunked_cross_entropy needs a frozen head (it forms no gradient for it)")
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else head.weight.dtype
    weight = head.weight.to(dtype)
    bias = None if head.bias is None else head.bias.to(dtype)
    parts = _compiled_softmax_parts() if compiled else softmax_parts
    return _ChunkedHeadCE.apply(hidden, weight, bias, labels, chunk, parts)


def softmax_parts(z: torch.Tensor, y: torch.Tensor):
    """Logits z [c, V] (the head's dtype), labels y [c] -> max m [c], argmax [c] (the first maximum),
    z_y [c], e = exp(z - m) [c, V] in z's dtype and its sum S [c]; float32 inside."""
    logits = z.float()
    top, guess = logits.max(-1)
    picked = logits.gather(1, y[:, None])[:, 0]
    e = (logits - top[:, None]).exp()
    return top, guess, picked, e.to(z.dtype), e.sum(-1)


@functools.cache
def _compiled_softmax_parts():
    return torch.compile(softmax_parts, dynamic=True)


class _ChunkedHeadCE(torch.autograd.Function):
    """Per chunk: logits z = h W^T (+ bias); with m, e and S from `softmax_parts`,
    ce = m + log S - z_y and d ce / d h = softmax(z) W - W_y = (e W) / S - W_y. A few passes over
    the [chunk, vocab] block (torch's logsumexp is several times slower than max, exp and sum)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk, parts):
        n = hidden.shape[0]
        ce = torch.empty(n, dtype=torch.float32, device=hidden.device)
        guess = torch.empty(n, dtype=torch.long, device=hidden.device)
        grad = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device) if ctx.needs_input_grad[0] else None
        with torch.autocast(hidden.device.type, enabled=False):
            for i in range(0, n, chunk):
                rows, y = slice(i, min(n, i + chunk)), labels[i:i + chunk]
                z = F.linear(hidden[rows].to(weight.dtype), weight, bias)  # [c, V]
                top, guess[rows], picked, e, total = parts(z, y)
                ce[rows] = top + total.log() - picked
                if grad is not None:
                    grad[rows] = (e @ weight).float().div_(total[:, None]).sub_(weight[y].float())
        ctx.save_for_backward(grad)
        ctx.hidden_dtype = hidden.dtype
        ctx.mark_non_differentiable(guess)
        return ce, guess

    @staticmethod
    def backward(ctx, grad_ce, _grad_guess):
        (grad,) = ctx.saved_tensors
        return (grad_ce[:, None] * grad).to(ctx.hidden_dtype), None, None, None, None, None
