"""The DFlash block-diffusion drafter: plain modules, one frozen config.

The drafter owns its decoder layers, the context fusion (`fc`, `hidden_norm`) and the final
norm. It does not own the embedding or the LM head: those are the target's, passed in frozen (the
head through `dflow.vocab`, which also owns the optional reduced draft vocabulary, `d2t`).
Attention layout (docs/DESIGN.md, "The block layout"): in every layer, that layer's k_proj/v_proj project the fused
context H (keys get k_norm and RoPE at their absolute positions) and the block hidden states;
context K/V come first; only block tokens make queries; no causal mask inside a block.
Training packs many blocks into one forward; `BlockChunks` lets them attend chunk by chunk, so
that the cost grows linearly with the number of blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from dflow.errors import DFlowError

BLOCK_SIZES = range(2, 65)  # B: the anchor and 1..63 drafts


def check_block_size(block_size: int, name: str = "block size") -> None:
    """The one check of a block size B; `name` is what the user set (a flag, a config key)."""
    if block_size not in BLOCK_SIZES:
        raise DFlowError(f"{name} must be in {BLOCK_SIZES[0]}..{BLOCK_SIZES[-1]}, got {block_size}")


def build_target_layer_ids(num_target_layers: int, num_fused: int) -> list[int]:
    """The `num_fused` target layers whose outputs feed the drafter, spread from layer 1 to L-3
    (DFlash fuses one per drafter layer; more or fewer is a config choice)."""
    if num_fused == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [round(start + i * (end - start) / (num_fused - 1)) for i in range(num_fused)]


@dataclass(frozen=True)
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    relay: bool = True  # carries a DFlow relay module (relay.* weights)
    relay_hidden_size: int = 0  # 0: same as hidden_size
    draft_vocab_size: int = 0  # 0: the full vocabulary; else N rows of the head, mapped by `d2t` (dflow.vocab)
    extra: dict = field(default_factory=dict, compare=False)  # unknown-to-us DFlash keys, kept on save

    def __post_init__(self):
        check_block_size(self.block_size, "block_size")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the vocabulary 0..{self.vocab_size - 1}")
        if not all(0 <= i < self.num_target_layers for i in self.target_layer_ids):
            raise ValueError(f"target_layer_ids {list(self.target_layer_ids)} out of range 0..{self.num_target_layers - 1}")
        if not 0 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} is outside 0..{self.vocab_size} (0: full)")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """positions [b, n] -> cos, sin [b, 1, n, head_dim] (HF's half-split layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    freqs = positions.float()[..., None] * inv_freq  # [b, n, head_dim/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, n, head_dim]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


@dataclass(frozen=True)
class BlockChunks:
    """How packed training blocks attend: chunk by chunk, so that cost grows linearly with the
    number of blocks (one dense mask over all blocks of a sequence grows with its square).
    A chunk (row, start, end, mask) holds the packed queries [start, end): whole blocks of the
    context row `row`. They see that row's first c context positions and their own chunk's keys,
    as the bool mask [1, 1, end - start, c + end - start] allows (True = visible)."""

    chunks: tuple[tuple[int, int, int, torch.Tensor], ...]

    def attend(self, q, k, v, ctx_k, ctx_v) -> torch.Tensor:
        """q [1, heads, nq, head_dim]; k, v [1, kv_heads, nq, head_dim] (the blocks'); ctx_k, ctx_v
        [rows, kv_heads, T, head_dim] -> [1, heads, nq, head_dim]."""
        if not self.chunks:
            return q.new_zeros(q.shape)
        # split/unbind, not one slice per chunk: a slice's backward writes a zero tensor of the
        # whole input, which would make the backward quadratic in the number of chunks
        sizes = [end - start for _, start, end, _ in self.chunks]
        rows_k, rows_v = ctx_k.unbind(0), ctx_v.unbind(0)
        out = []
        for (row, _, _, mask), qc, kc, vc in zip(self.chunks, q.split(sizes, 2), k.split(sizes, 2), v.split(sizes, 2)):
            c = mask.shape[-1] - qc.shape[2]  # context positions the chunk may see
            keys = torch.cat([rows_k[row][None, :, :c], kc], dim=2)
            values = torch.cat([rows_v[row][None, :, :c], vc], dim=2)
            out.append(F.scaled_dot_product_attention(qc, keys, values, attn_mask=mask, enable_gqa=True))
        return torch.cat(out, dim=2)


def attend(q, k, v, ctx_k, ctx_v, mask=None) -> torch.Tensor:
    """Block queries over [context | block] keys: q [b, heads, q, head_dim]; k, v [b, kv_heads, q,
    head_dim] (the block's); ctx_k, ctx_v [b, kv_heads, c, head_dim]; mask: None (see everything),
    bool [b or 1, 1, q, c + q] (True = visible), or BlockChunks (q holds packed blocks of the ctx
    rows, b = 1) -> [b, heads, q, head_dim]."""
    if isinstance(mask, BlockChunks):
        return mask.attend(q, k, v, ctx_k, ctx_v)
    return F.scaled_dot_product_attention(q, torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2),
                                          attn_mask=mask, enable_gqa=True)


class Attention(nn.Module):
    """The projections of one layer's attention (the attention itself is `attend`)."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, cfg.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, n, self.cfg.head_dim).transpose(1, 2)

    def query(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [b, t, hidden] -> q [b, heads, t, head_dim] (normed and rotated)."""
        return apply_rope(self.q_norm(self._heads(self.q_proj(x), self.cfg.num_attention_heads)), cos, sin)

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [b, t, hidden] -> k, v [b, kv_heads, t, head_dim] (k normed and rotated)."""
        k = self.k_norm(self._heads(self.k_proj(x), self.cfg.num_key_value_heads))
        v = self._heads(self.v_proj(x), self.cfg.num_key_value_heads)
        return apply_rope(k, cos, sin), v

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """out [b, heads, t, head_dim] -> [b, t, hidden] (shapes explicit: no block at all is a valid batch)."""
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.cfg.num_attention_heads * self.cfg.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """forward = after_attention(x, attend(before_attention(x), context K/V)); the two halves are
    apart so that `DFlashDrafter.compile_layers` can compile them around the attention."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def before_attention(self, x, cos, sin):
        """x [b, q, hidden] -> the block's q [b, heads, q, head_dim], k, v [b, kv_heads, q, head_dim]."""
        h = self.input_layernorm(x)
        return (self.self_attn.query(h, cos, sin), *self.self_attn.key_value(h, cos, sin))

    def after_attention(self, x, out):
        """x [b, q, hidden] (the layer's input), out [b, heads, q, head_dim] -> the layer's output."""
        x = x + self.self_attn.output(out)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask=None):
        return self.after_attention(x, attend(*self.before_attention(x, cos, sin), ctx_k, ctx_v, mask))


class DFlashDrafter(nn.Module):
    """Predicts a block's B-1 masked tokens in one pass, conditioned on fused target features.

    Usage per round: `project` new committed target features, turn them into per-layer
    context K/V with `context_kv` (cached by the caller), then `forward` the block.
    """

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # [N] the target id of each draft id (dflow.vocab); None: the full vocabulary, no key on disk
        self.register_buffer("d2t", torch.arange(cfg.draft_vocab_size) if cfg.draft_vocab_size else None)
        self.compiled = None  # (before_attention, after_attention) from `compile_layers`

    def compile_layers(self) -> None:
        """torch.compile every layer's work around its attention (norms, projections, RoPE, MLP),
        shared by all layers: on the CPU it fuses the elementwise passes that weigh most in a
        training step. Training mode only; needs a C++ compiler; the first forward compiles (a
        minute or two)."""
        self.compiled = tuple(torch.compile(f, dynamic=True)
                              for f in (DecoderLayer.before_attention, DecoderLayer.after_attention))

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """features [b, t, n_layers * hidden] (raw target states) -> H [b, t, hidden]."""
        return self.hidden_norm(self.fc(features))

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        return rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, dtype)

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """ctx [b, c, hidden] (projected), positions [b, c] -> per layer (k, v) [b, kv_heads, c, head_dim]."""
        cos, sin = self.rope(positions, ctx.dtype)
        return [layer.self_attn.key_value(ctx, cos, sin) for layer in self.layers]

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx_kv, mask=None) -> torch.Tensor:
        """x [b, q, hidden] block inputs; positions [b, q]; ctx_kv from `context_kv` (or a cache);
        mask as in `attend` -> normed hidden states [b, q, hidden]."""
        cos, sin = self.rope(positions, x.dtype)
        for layer, (k, v) in zip(self.layers, ctx_kv):
            if self.compiled is None or not self.training:  # decoding (eval) stays eager
                x = layer(x, cos, sin, k, v, mask)
            else:
                before, after = self.compiled
                x = after(layer, x, attend(*before(layer, x, cos, sin), k, v, mask))
        return self.norm(x)


class ContextCache:
    """Per-layer context K/V of committed positions, preallocated for `capacity` positions and
    written in place by position: a round costs its new entries only, never a copy of the whole
    context. Never cropped: only committed positions enter it, so nothing is ever rolled back.
    A write past the capacity grows the buffers (by doubling), which the engine never needs."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.k: list[torch.Tensor] = []  # per layer [1, kv_heads, capacity, head_dim]
        self.v: list[torch.Tensor] = []
        self.length = 0  # positions 0..length-1 are filled

    def write(self, kv: list[tuple[torch.Tensor, torch.Tensor]], position: int) -> None:
        """kv: per layer (k, v) [1, kv_heads, t, head_dim] of positions position..position+t-1
        (position <= length: a write continues the context, or overwrites its tail)."""
        end = position + kv[0][0].shape[2]
        if not self.k or end > self.k[0].shape[2]:
            self._grow(kv, max(end, self.capacity, 2 * self.k[0].shape[2] if self.k else 0))
        for i, (k, v) in enumerate(kv):
            self.k[i][:, :, position:end] = k
            self.v[i][:, :, position:end] = v
        self.length = end

    def _grow(self, kv, capacity: int) -> None:
        """New buffers of `capacity` positions, shaped like `kv`, holding the filled positions."""
        old_k, old_v = self.k, self.v
        self.k = [k.new_empty(*k.shape[:2], capacity, k.shape[3]) for k, _ in kv]
        self.v = [v.new_empty(*v.shape[:2], capacity, v.shape[3]) for _, v in kv]
        for i in range(len(old_k)):
            self.k[i][:, :, :self.length] = old_k[i][:, :, :self.length]
            self.v[i][:, :, :self.length] = old_v[i][:, :, :self.length]

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (k, v) [1, kv_heads, length, head_dim]: views of the filled positions."""
        if not self.k:
            raise RuntimeError("the context cache is empty: the prompt's features come first")
        return [(k[:, :, :self.length], v[:, :, :self.length]) for k, v in zip(self.k, self.v)]
