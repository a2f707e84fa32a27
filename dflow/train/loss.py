"""The draft positions' cross entropy through the target's frozen LM head, without ever holding
[positions, vocab] float32 logits: the head and the loss run a chunk of positions at a time, and
the gradient with respect to the hidden states is formed in the same pass (the head is frozen, so
that is the only gradient there is). `full_cross_entropy` is the plain reference it must equal.

Two kinds of label (`dflow train --loss`): `ce`, the data's token (hard labels, DFlash's loss), and
`kl`, the target's own next-token distribution at that position (its final state through the same
head: softmax over the draft vocabulary's rows), i.e. the cross entropy H(p_target, q_draft) =
KL(p_target || q_draft) + H(p_target), whose gradient is KL's.
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
    weight, bias = _frozen_head(head, hidden)
    parts = _compiled_softmax_parts() if compiled else softmax_parts
    return _ChunkedHeadCE.apply(hidden, weight, bias, labels, chunk, parts)


def _frozen_head(head: nn.Module, hidden: torch.Tensor):
    """The head's weight and bias in the dtype its matmuls run in (autocast's when on); ValueError
    unless the head is frozen (the chunked losses form no gradient for it)."""
    if head.weight.requires_grad or (head.bias is not None and head.bias.requires_grad):
        raise ValueError("the chunked losses need a frozen head (they form no gradient for it)")
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else head.weight.dtype
    return head.weight.to(dtype), None if head.bias is None else head.bias.to(dtype)


def draft_loss(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, teacher: torch.Tensor | None,
               reference: bool = False, compiled: bool = False, chunk: int = CHUNK_POSITIONS):
    """The draft positions' loss: hidden [n, hidden] against the data's tokens labels [n] (`--loss
    ce`), or against the target's distribution from its states teacher [n, hidden] (`--loss kl`)
    -> (loss [n] float32, argmax [n]); `reference`: the full-logits form the chunked one equals."""
    if teacher is None:
        return full_cross_entropy(head, hidden, labels) if reference else \
            chunked_cross_entropy(head, hidden, labels, chunk, compiled)
    return full_soft_cross_entropy(head, hidden, teacher) if reference else \
        chunked_soft_cross_entropy(head, hidden, teacher, chunk, compiled)


def full_soft_cross_entropy(head: nn.Module, hidden: torch.Tensor, teacher: torch.Tensor):
    """Reference: hidden [n, hidden], the target's final states teacher [n, hidden] -> (H(p, q) [n]
    float32 with p = softmax(head(teacher)) and q = softmax(head(hidden)), argmax of q [n])."""
    logits = apply_head(head, hidden.to(head.weight.dtype)).float()  # [n, V]
    with torch.no_grad():
        p = apply_head(head, teacher.to(head.weight.dtype)).float().softmax(-1)  # [n, V]
    return -(p * logits.log_softmax(-1)).sum(-1), logits.detach().argmax(-1)


def chunked_soft_cross_entropy(head: nn.Module, hidden: torch.Tensor, teacher: torch.Tensor,
                               chunk: int = CHUNK_POSITIONS, compiled: bool = False):
    """Same values and gradient as `full_soft_cross_entropy`, `chunk` positions at a time (as
    `chunked_cross_entropy`). hidden, teacher [n, hidden] -> (H(p, q) [n] float32, argmax [n])."""
    weight, bias = _frozen_head(head, hidden)
    parts = _compiled_soft_parts() if compiled else soft_parts
    return _ChunkedHeadSoftCE.apply(hidden, weight, bias, teacher.detach(), chunk, parts)


def soft_parts(z: torch.Tensor, zt: torch.Tensor):
    """Draft logits z and target logits zt [c, V] -> H(p, q) [c], argmax of z [c] and
    softmax(z) - p [c, V] float32 (the gradient of H with respect to z), with p = softmax(zt);
    max, exp and sum rather than torch's slower log-softmax, as `softmax_parts`."""
    logits, target = z.float(), zt.float()
    top, guess = logits.max(-1)
    shifted = logits - top[:, None]
    e = shifted.exp()
    total = e.sum(-1)
    p = (target - target.max(-1).values[:, None]).exp()
    p = p / p.sum(-1, keepdim=True)
    return total.log() - (p * shifted).sum(-1), guess, e.div_(total[:, None]).sub_(p)


@functools.cache
def _compiled_soft_parts():
    return torch.compile(soft_parts, dynamic=True)


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


class _ChunkedHead(torch.autograd.Function):
    """The shared frame of the chunked losses: per chunk of rows the logits z = h W^T (+ bias), from
    which the subclass's `chunk_loss` gives the loss, the argmax and, when asked, d loss / d h; the
    gradient is formed in the forward (the head is frozen) and scaled in the backward."""

    @staticmethod
    def run(ctx, hidden, weight, bias, chunk, chunk_loss):
        n = hidden.shape[0]
        ce = torch.empty(n, dtype=torch.float32, device=hidden.device)
        guess = torch.empty(n, dtype=torch.long, device=hidden.device)
        grad = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device) if ctx.needs_input_grad[0] else None
        with torch.autocast(hidden.device.type, enabled=False):
            for i in range(0, n, chunk):
                rows = slice(i, min(n, i + chunk))
                z = F.linear(hidden[rows].to(weight.dtype), weight, bias)  # [c, V]
                ce[rows], guess[rows], grad_of = chunk_loss(rows, z)
                if grad is not None:
                    grad[rows] = grad_of()  # [c, hidden]
        ctx.save_for_backward(grad)
        ctx.hidden_dtype = hidden.dtype
        ctx.mark_non_differentiable(guess)
        return ce, guess

    @staticmethod
    def backward(ctx, grad_ce, _grad_guess):
        (grad,) = ctx.saved_tensors
        return (grad_ce[:, None] * grad).to(ctx.hidden_dtype), None, None, None, None, None


class _ChunkedHeadCE(_ChunkedHead):
    """With m, e and S from `softmax_parts`: ce = m + log S - z_y and d ce / d h = softmax(z) W - W_y
    = (e W) / S - W_y. A few passes over the [chunk, vocab] block (torch's logsumexp is several
    times slower than max, exp and sum)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk, parts):
        def chunk_loss(rows, z):
            y = labels[rows]
            top, guess, picked, e, total = parts(z, y)
            return (top + total.log() - picked, guess,
                    lambda: (e @ weight).float().div_(total[:, None]).sub_(weight[y].float()))
        return _ChunkedHead.run(ctx, hidden, weight, bias, chunk, chunk_loss)


class _ChunkedHeadSoftCE(_ChunkedHead):
    """With zt = t W^T (+ bias) and p = softmax(zt): H = -sum p log softmax(z) and
    d H / d h = (softmax(z) - p) W (`soft_parts`)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, teacher, chunk, parts):
        def chunk_loss(rows, z):
            ce, guess, dz = parts(z, F.linear(teacher[rows].to(weight.dtype), weight, bias))
            return ce, guess, lambda: (dz.to(weight.dtype) @ weight).float()
        return _ChunkedHead.run(ctx, hidden, weight, bias, chunk, chunk_loss)
