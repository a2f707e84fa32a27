"""dflow/attention.py gives transformers' `sdpa` numbers bit for bit: the attention function, its
additive mask and the in-place cache, on every supported architecture, with and without a cache."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from conftest import ARCHS, TINY_VOCAB, tiny_target
from dflow.attention import NAME, SlabLayer, decode_cache, dflow_sdpa_mask, sdpa_backends, use_dflow_attention
from dflow.engine import generate
from dflow.proposers import DrafterProposer
from dflow.targets import crop_cache
from test_engine import hf_greedy, random_drafter


def pair(arch: str):
    """(stock sdpa target, the same weights on dflow_sdpa)."""
    stock, ours = tiny_target(arch), tiny_target(arch)
    assert stock.config._attn_implementation == "sdpa"
    use_dflow_attention(ours)
    assert ours.config._attn_implementation == NAME
    return stock, ours


@torch.no_grad()
def run(target, cache, ids, start, **kw):
    """One forward of ids [b, t] at positions start.. over `cache` -> logits."""
    pos = torch.arange(start, start + ids.shape[1])[None].expand(ids.shape[0], -1)
    return target(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=cache is not None, **kw).logits


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_same_logits_as_sdpa(arch):
    """Prefill (no cache: is_causal), a 16-token block over a cache (a mask), one token, a crop."""
    stock, ours = pair(arch)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, TINY_VOCAB, (1, 90), generator=g)
    ref_cache, new_cache = DynamicCache(config=stock.config), decode_cache(ours.config, 64)  # grows past 64
    assert torch.equal(run(stock, None, ids, 0), run(ours, None, ids, 0))
    steps = [(0, 40), (40, 56), (56, 57), (57, 90)]
    for a, b in steps:
        assert torch.equal(run(stock, ref_cache, ids[:, a:b], a), run(ours, new_cache, ids[:, a:b], a)), (a, b)
        crop_cache(ref_cache, b - 3), crop_cache(new_cache, b - 3)
        assert new_cache.get_seq_length() == ref_cache.get_seq_length() == b - 3
        ids[:, b - 3:] = torch.randint(4, TINY_VOCAB, (1, 90 - b + 3), generator=g)  # rejected: re-drafted
        a2 = b - 3
        assert torch.equal(run(stock, ref_cache, ids[:, a2:b], a2), run(ours, new_cache, ids[:, a2:b], a2))
    for r, n in zip(ref_cache.layers, new_cache.layers):
        assert torch.equal(r.keys, n.keys) and torch.equal(r.values, n.values)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_same_logits_under_a_custom_mask(arch):
    """Training's path (dflow/train/rollout.py): a batch, an additive 4D mask, a DynamicCache."""
    stock, ours = pair(arch)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, TINY_VOCAB, (2, 30), generator=g)
    caches = [DynamicCache(config=stock.config), DynamicCache(config=ours.config)]
    for model, cache in zip((stock, ours), caches):
        run(model, cache, ids[:, :20], 0)
    allowed = torch.ones(2, 1, 10, 30, dtype=torch.bool).tril(20)
    allowed[1, :, :, 5:9] = False
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    ref, new = (run(m, c, ids[:, 20:], 20, attention_mask=mask) for m, c in zip((stock, ours), caches))
    assert torch.equal(ref, new)


def test_mask_is_torchs_own_conversion():
    mask = dflow_sdpa_mask(batch_size=1, q_length=3, kv_length=5, q_offset=2, dtype=torch.bfloat16)
    assert mask.dtype == torch.bfloat16 and mask.shape == (1, 1, 3, 5)
    expect = torch.ones(3, 5, dtype=torch.bool).tril(2)
    assert torch.equal(mask[0, 0] == 0, expect) and bool((mask[0, 0][~expect] == float("-inf")).all())
    assert dflow_sdpa_mask(batch_size=1, q_length=1, kv_length=5, q_offset=4, dtype=torch.float32) is None


def test_one_buffer_serves_a_generation():
    target = tiny_target("llama")
    cache = decode_cache(target.config, 128)
    ids = torch.randint(4, TINY_VOCAB, (1, 100))
    run(target, cache, ids[:, :50], 0)
    layer = cache.layers[0]
    assert isinstance(layer, SlabLayer) and layer.key_buffer.shape[-2] == 128
    ptr = layer.key_buffer.data_ptr()
    for s in range(50, 100, 10):
        run(target, cache, ids[:, s:s + 16], s)
        crop_cache(cache, s + 10)
    assert layer.key_buffer.data_ptr() == ptr and layer.keys.data_ptr() == ptr
    assert cache.get_seq_length() == 100


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_decoding_stays_greedy(arch):
    """The engine on dflow_sdpa and its in-place cache reproduces stock HF greedy decoding."""
    stock, ours = pair(arch)
    drafter = random_drafter(ours)
    for n in (1, 17, 60):
        prompt = torch.randint(4, TINY_VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        ref = hf_greedy(stock, prompt, 40)
        assert generate(ours, prompt, max_new_tokens=40).token_ids == ref
        for relay in (False, True):
            r = generate(ours, prompt, proposer=DrafterProposer(drafter, ours, use_relay=relay), block_size=8,
                         max_new_tokens=40)
            assert r.token_ids == ref, (arch, n, relay)


def test_elsewhere_it_is_transformers_sdpa(monkeypatch):
    """Off the CPU (here: pretended) `dflow_sdpa` and its mask hand over to transformers' own."""
    import dflow.attention as attention

    monkeypatch.setattr(attention, "fused_masked_gqa", lambda device: False)
    assert dflow_sdpa_mask(batch_size=1, q_length=3, kv_length=5, q_offset=2, dtype=torch.float32).dtype == torch.bool
    stock, ours = pair("qwen3")
    ids = torch.randint(4, TINY_VOCAB, (1, 40), generator=torch.Generator().manual_seed(2))
    caches = DynamicCache(config=stock.config), decode_cache(ours.config, 40)
    for a, b in ((0, 24), (24, 40)):
        assert torch.equal(run(stock, caches[0], ids[:, a:b], a), run(ours, caches[1], ids[:, a:b], a))


def test_sdpa_backends_keep_cudnn_out_on_a_gpu_only():
    """On CUDA every SDPA kernel but cuDNN's may run (its per-shape plans made a GPU training step
    take 38 s); the setting is scoped; on the CPU nothing changes."""
    before = [torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled(),
              torch.backends.cuda.mem_efficient_sdp_enabled(), torch.backends.cuda.math_sdp_enabled()]
    with sdpa_backends(torch.device("cuda")):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
        assert torch.backends.cuda.math_sdp_enabled()
    with sdpa_backends(torch.device("cpu")):
        assert torch.backends.cuda.cudnn_sdp_enabled() == before[0]
    assert [torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled(),
            torch.backends.cuda.mem_efficient_sdp_enabled(), torch.backends.cuda.math_sdp_enabled()] == before


def recording_backends(monkeypatch, module) -> list:
    """Patch `module.sdpa_backends` to record the devices it is entered for (and change nothing)."""
    import contextlib

    seen = []

    @contextlib.contextmanager
    def record(device):
        seen.append(torch.device(device).type)
        yield

    monkeypatch.setattr(module, "sdpa_backends", record)
    return seen


def test_decoding_runs_under_the_sdpa_choice(monkeypatch):
    """The engine's whole generation, AR and speculative, runs inside sdpa_backends(target's device)."""
    import dflow.engine as engine

    _, ours = pair("llama")
    seen = recording_backends(monkeypatch, engine)
    assert generate(ours, [5, 6, 7], max_new_tokens=4).token_ids
    generate(ours, [5, 6, 7], proposer=DrafterProposer(random_drafter(ours), ours), block_size=4, max_new_tokens=4)
    assert seen == ["cpu", "cpu"]
