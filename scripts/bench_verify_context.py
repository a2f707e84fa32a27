"""One verification forward (a 16-token block) at two cache lengths: how much of its growth is
attention math and how much was overhead (issue 15), interleaved, best of N, in one run.

    python scripts/bench_verify_context.py [--contexts 128 1088] [--runs 7]

Per cache length T (positions before the block) on the default target (bf16):
  - `stock`: transformers' `sdpa` over a `DynamicCache` (repeat_kv + torch.cat per layer);
  - `dflow`: `dflow_sdpa` over `attention.decode_cache` (what the engine runs);
  - `attention`: SDPA alone, the target's layers' shapes (the math no cache layout removes);
and the minimal costs: K/V bytes read per forward vs the weights' bytes, and FLOPs.
The default contexts are the mean cache lengths of bench_decode_length.py's 128- and 2,048-token
runs (48-token prompt, + half the output, + the block).
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import DynamicCache

from dflow.attention import NAME, decode_cache
from dflow.targets import crop_cache, load_target

BLOCK = 16


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs=2, default=(128, 1088))
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    target, _ = load_target("smollm2-135m", "bfloat16")
    c = target.config
    L, hq, hk = c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads
    d = getattr(c, "head_dim", None) or c.hidden_size // hq
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, c.vocab_size, (1, max(args.contexts)), generator=g)
    block = torch.randint(0, c.vocab_size, (1, BLOCK), generator=g)
    impl = {"stock": "sdpa", "dflow": NAME}
    caches = {}
    for name in impl:
        target.set_attn_implementation(impl[name])
        for T in args.contexts:
            cache = DynamicCache(config=c) if name == "stock" else decode_cache(c, T + BLOCK)
            with torch.inference_mode():
                target(input_ids=prompt[:, :T], past_key_values=cache, use_cache=True, logits_to_keep=1)
            caches[name, T] = cache
    kv = {T: [(torch.randn(1, hk, T + BLOCK, d, dtype=torch.bfloat16),) * 2 for _ in range(L)] for T in args.contexts}

    @torch.inference_mode()
    def verify(name, T):
        target.set_attn_implementation(impl[name])
        t = time.perf_counter()
        target(input_ids=block, position_ids=torch.arange(T, T + BLOCK)[None], past_key_values=caches[name, T],
               use_cache=True)
        dt = time.perf_counter() - t
        crop_cache(caches[name, T], T)
        return dt

    @torch.inference_mode()
    def attention(T):
        allowed = torch.ones(1, 1, BLOCK, T + BLOCK, dtype=torch.bool).tril(T)
        mask = torch.zeros(allowed.shape, dtype=torch.bfloat16).masked_fill_(~allowed, float("-inf"))
        q = torch.randn(1, BLOCK, hq, d, dtype=torch.bfloat16).transpose(1, 2)
        t = time.perf_counter()
        for k, v in kv[T]:
            torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return time.perf_counter() - t

    best = {}
    for _ in range(args.runs):
        for T in args.contexts:
            for name, fn in (("stock", lambda: verify("stock", T)), ("dflow", lambda: verify("dflow", T)),
                             ("attention", lambda: attention(T))):
                best[name, T] = min(best.get((name, T), float("inf")), fn())
    short, long = args.contexts
    for name in ("stock", "dflow", "attention"):
        a, b = best[name, short] * 1e3, best[name, long] * 1e3
        print(f"{name:9s} T={short}: {a:7.2f} ms  T={long}: {b:7.2f} ms  growth {b - a:6.2f} ms  ratio {b / a:.3f}")
    weights = sum(p.numel() for p in target.parameters()) * 2
    kv_bytes = L * 2 * hk * d * 2  # bf16 K and V, per position
    linear = 2 * sum(p.numel() for p in target.parameters()) * BLOCK
    for T in args.contexts:
        n = T + BLOCK
        print(f"T={T}: K/V read {kv_bytes * n / 1e6:6.1f} MB vs weights {weights / 1e6:.0f} MB; attention "
              f"{4 * hq * d * BLOCK * n * L / 1e9:.2f} GFLOP vs linear {linear / 1e9:.2f} GFLOP; "
              f"{hq * BLOCK * n * L / 1e6:.1f} M softmax exps")
    floor = best["dflow", short] + best["attention", long] - best["attention", short]
    print(f"verify floor at T={long} (dflow at T={short} + the attention math's growth): {floor * 1e3:.2f} ms; "
          f"dflow is {best['dflow', long] / floor:.3f} x it, stock {best['stock', long] / floor:.3f} x")


if __name__ == "__main__":
    main()
