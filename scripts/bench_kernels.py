"""This core's raw rates, the yardsticks of docs/measurements.md's issue-15 floor: a large matmul's
GFLOP/s in bf16 and float32, and the time of torch's `exp` over N values (softmax's exponentials).

    OMP_NUM_THREADS=1 taskset -c 1 python scripts/bench_kernels.py [--size 2048] [--exps 4200000] [--runs 7]

Best of --runs each, one thread.
"""

from __future__ import annotations

import argparse
import time

import torch


def best_seconds(fn, runs: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=2048, help="square matmul side")
    ap.add_argument("--exps", type=int, default=4_200_000, help="values for exp")
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    n = args.size
    for dtype in (torch.bfloat16, torch.float32):
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        s = best_seconds(lambda: a @ b, args.runs)
        print(f"matmul {n}x{n} {dtype}: {2 * n**3 / s / 1e9:.1f} GFLOP/s")
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(args.exps, dtype=dtype)
        y = torch.empty_like(x)
        s = best_seconds(lambda: torch.exp(x, out=y), args.runs)
        print(f"exp of {args.exps:,} {dtype} values: {s * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
