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

# Positions per chunk (256 x 49,152 float32 logits: 50 MB), wide enough for efficient head matmuls.
CHUNK_POSITIONS = 256


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
    """Per chunk: logits z = h W^T (+ bias) in float32; with m = max z, e = exp(z - m) and its sum S,
    ce = m + log S - z_y; d ce / d h = softmax(z) W - W_y = (e W) / S - W_y. Few passes over the
    [chunk, vocab] block (torch's logsumexp is several times slower than max, exp and sum here)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk):
        n, vocab = hidden.shape[0], weight.shape[0]
        ce = torch.empty(n, dtype=torch.float32, device=hidden.device)
        guess = torch.empty(n, dtype=torch.long, device=hidden.device)
        grad = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device) if ctx.needs_input_grad[0] else None
        # one float32 [chunk, vocab] buffer (and one in the head's dtype) reused by every chunk:
        # fresh blocks this large are mapped and unmapped on each allocation, which is slow
        logits_buf = torch.empty(min(n, chunk), vocab, dtype=torch.float32, device=hidden.device)
        low = logits_buf if weight.dtype == torch.float32 else torch.empty_like(logits_buf, dtype=weight.dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for i in range(0, n, chunk):
                rows, y = slice(i, min(n, i + chunk)), labels[i:i + chunk]
                c = len(y)
                z = torch.mm(hidden[rows].to(weight.dtype), weight.t(), out=low[:c])  # [c, V]
                if bias is not None:
                    z += bias
                logits = z if low is logits_buf else logits_buf[:c].copy_(z)
                top, guess[rows] = logits.max(-1)  # the first maximum, as argmax
                picked = logits.gather(1, y[:, None])[:, 0]
                e = logits.sub_(top[:, None]).exp_()  # in place: the logits are not needed again
                total = e.sum(-1)
                ce[rows] = top + total.log() - picked
                if grad is not None:
                    e = e if low is logits_buf else low[:c].copy_(e)
                    grad[rows] = (e @ weight).float().div_(total[:, None]).sub_(weight[y].float())
        ctx.save_for_backward(grad)
        ctx.hidden_dtype = hidden.dtype
        ctx.mark_non_differentiable(guess)
        return ce, guess

    @staticmethod
    def backward(ctx, grad_ce, _grad_guess):
        (grad,) = ctx.saved_tensors
        return (grad_ce[:, None] * grad).to(ctx.hidden_dtype), None, None, None, None
