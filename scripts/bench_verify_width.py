"""What one target forward costs by the number of tokens it verifies, against one token (the `ar`
step): the ratio decides the tau a block size needs before `dflow` pays, and it depends on the
machine and dtype (bf16 on AVX-512/AMX CPUs: about 1.2-1.3x for 16 tokens; float32 on AVX2: much
more). Median of N forwards per width over a cache of C positions, widths interleaved, one run.

    OMP_NUM_THREADS=1 taskset -c 1 python scripts/bench_verify_width.py [--dtype float32] [--widths 1,4,8,16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dflow.targets import DEFAULT_TARGET, crop_cache, describe_device, load_target


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    ap.add_argument("--widths", default="1,4,8,16", help="tokens per forward, comma-separated")
    ap.add_argument("--context", type=int, default=256, help="cache positions before the block")
    ap.add_argument("--runs", type=int, default=12)
    args = ap.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    model, _ = load_target(args.target, args.dtype)
    vocab = model.config.vocab_size
    times: dict[int, list[float]] = {w: [] for w in widths}
    with torch.inference_mode():
        cache = model(torch.randint(0, vocab, (1, args.context)), use_cache=True).past_key_values
        for _ in range(args.runs):
            for w in widths:  # interleaved, so drift hits every width alike
                block = torch.randint(0, vocab, (1, w))
                start = time.perf_counter()
                model(block, past_key_values=cache, use_cache=True)
                times[w].append(time.perf_counter() - start)
                crop_cache(cache, args.context)
    ms = {w: 1000 * statistics.median(t) for w, t in times.items()}
    print(f"{args.target} {args.dtype} on {describe_device(torch.device('cpu'))}, {torch.get_num_threads()} thread(s), "
          f"cache {args.context}: " + ", ".join(f"{w} tok {ms[w]:.1f} ms ({ms[w] / ms[widths[0]]:.2f}x)" for w in widths))


if __name__ == "__main__":
    main()
