"""The target's attention and KV cache for decoding: the same numbers as transformers' `sdpa`, at a
cost that grows only with the attention math itself as the context grows (issue 15).

Three overheads of stock transformers, each a pass over the whole KV cache per layer per forward,
which on a verification block of 16 tokens over a long context cost as much as the math:
  - `repeat_kv`: under an attention mask the `sdpa` path copies the K/V heads up to the query
    heads (GQA). `dflow_sdpa` passes `enable_gqa=True` instead, on the CPU, whose fused kernel
    takes it with a mask; elsewhere it is transformers' `sdpa` as is (CUDA's masked GQA kernel is
    the math one, and other kernels are not checked bit for bit).
  - the boolean mask: torch turns it into an additive one inside every layer's SDPA call;
    `dflow_sdpa_mask` does it once per forward on the CPU, as torch would (0 / -inf, in the
    query's dtype).
  - `DynamicLayer.update`'s `torch.cat`: `SlabLayer` writes into a preallocated buffer and hands
    out views of it; a crop only shortens the view.
SDPA gives bit-identical outputs either way (tests/test_attention.py), so decoding is unchanged.

`use_dflow_attention(model)` switches a loaded `sdpa` target over; `decode_cache(config,
capacity)` is the engine's cache; `sdpa_backends(device)` keeps torch's SDPA off cuDNN on a GPU.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "dflow_sdpa"
# On a GPU, every SDPA kernel but cuDNN's (see sdpa_backends).
GPU_SDPA_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def sdpa_backends(device: torch.device) -> AbstractContextManager:
    """The context every forward and backward of dflow runs in on `device`: on CUDA, torch's SDPA
    may choose any kernel but cuDNN's; elsewhere torch chooses as it always does.

    Why: torch (2.11 here) tries cuDNN first for masked attention on Hopper and newer GPUs, and
    cuDNN builds an execution plan for every shape it has not seen (tenths of a second each).
    dflow's shapes change all the time (a training step's chunks of blocks, the decode context
    growing by a block a round, padded generation batches): a training step at batch 32 on an
    H200 took 38 s of one busy CPU core, inside the backward pass (docs/training.md, "On a GPU")."""
    if device.type != "cuda":
        return nullcontext()
    return sdpa_kernel(list(GPU_SDPA_BACKENDS))


def fused_masked_gqa(device: torch.device) -> bool:
    """Does torch's SDPA run GQA under an attention mask in its fused kernel on this device, with
    the outputs of repeated K/V heads (checked: the CPU)?"""
    return device.type == "cpu"


def dflow_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
               is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' `sdpa_attention_forward` without its `repeat_kv` copies (the CPU; elsewhere that function).
    query [b, hq, q, d], key / value [b, hk, kv, d] (hq a multiple of hk), attention_mask None or
    [b, 1, q, kv] -> ([b, q, hq, d], None)."""
    special = kwargs.get("position_bias") is not None or kwargs.get("cache") is not None
    if special or not fused_masked_gqa(query.device):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    q_len, kv_len = query.shape[2], key.shape[2]
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # SDPA's is_causal is top-left aligned: right only without a cache (the mask is None then, as
    # transformers decides); as in sdpa_attention_forward, an empty preallocated tail is cut off.
    is_causal = q_len > 1 and attention_mask is None and is_causal
    if is_causal and kv_len > q_len:
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                           dropout_p=dropout, scale=scaling, is_causal=is_causal,
                                                           enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def dflow_sdpa_mask(*args, dtype: torch.dtype | None = None, **kwargs) -> torch.Tensor | None:
    """transformers' `sdpa_mask`, made additive once on the CPU (0 where True, -inf where False,
    in `dtype`) as torch's SDPA does to a boolean mask in each layer: [b, 1, q, kv] or None."""
    mask = sdpa_mask(*args, **kwargs)
    if mask is None or mask.dtype != torch.bool or dtype is None or not fused_masked_gqa(mask.device):
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


AttentionInterface.register(NAME, dflow_sdpa)
AttentionMaskInterface.register(NAME, dflow_sdpa_mask)


def use_dflow_attention(model) -> None:
    """Switch a model on transformers' `sdpa` to `dflow_sdpa` (same outputs); others stay as they are."""
    if model.config._attn_implementation == "sdpa":
        model.set_attn_implementation(NAME)


class SlabLayer(DynamicLayer):
    """A `DynamicLayer` over a preallocated [b, h, capacity, d] buffer: `update` writes the new
    positions in place and returns views of the first `length` ones; `crop` (inherited) shortens
    the views. Past the capacity it reallocates at twice the size (a copy, as `torch.cat` would)."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.keys = self.values = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key_states / value_states [b, h, t, d] at positions length..length+t-1 -> all [b, h, length+t, d]."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, t = self.get_seq_length(), key_states.shape[-2]
        if self.keys is None or self.key_buffer.shape[-2] < n + t:
            self.key_buffer = self._grow(self.keys, key_states, n + t)
            self.value_buffer = self._grow(self.values, value_states, n + t)
        self.key_buffer[..., n:n + t, :].copy_(key_states)
        self.value_buffer[..., n:n + t, :].copy_(value_states)
        self.keys, self.values = self.key_buffer[..., :n + t, :], self.value_buffer[..., :n + t, :]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return 0 if not self.is_initialized or self.keys is None else self.keys.shape[-2]

    def _grow(self, old: torch.Tensor | None, new: torch.Tensor, need: int) -> torch.Tensor:
        size = max(need, self.capacity, 2 * old.shape[-2] if old is not None else 0)
        buf = new.new_empty(*new.shape[:-2], size, new.shape[-1])
        if old is not None:
            buf[..., :old.shape[-2], :].copy_(old)
        return buf

    def reset(self) -> None:
        super().reset()
        self.key_buffer = self.value_buffer = None


def decode_cache(config, capacity: int) -> DynamicCache:
    """A `DynamicCache` for one generation of up to `capacity` positions whose full-attention
    layers are `SlabLayer`s (sliding-window ones stay as transformers makes them)."""
    cache = DynamicCache(config=config)
    cache.layers = [SlabLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache
