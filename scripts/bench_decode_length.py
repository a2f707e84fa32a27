"""Does a decode round get slower as the output grows? (issue 15's bar), printed in one run.

    python scripts/bench_decode_length.py [--lengths 128,2048] [--ar-tokens 256] [--repeats 1]

On the default target (bf16) and the shipped drafter, one prompt, stop tokens ignored so every run
reaches its length:
  - `dflow` mean round time (draft + relay + verify + bookkeeping, ms) at each of `--lengths` new
    tokens, with the split, and the ratio of the last length's to the first's (bar: <= 1.05), for
    the whole round and for its draft part (the drafter and its context cache);
  - `ar` decode tokens/s at `--ar-tokens` new tokens (run this script before and after a change:
    unchanged within noise).
The runs are interleaved (each length, then ar, then again) so that machine drift hits them alike.
"""

from __future__ import annotations

import argparse

import torch

from dflow import metrics
from dflow.engine import generate
from dflow.pipeline import Pipeline

PROMPT = "Write a long story about a lighthouse keeper and the ships she guides, chapter by chapter."


def decode(pipe: Pipeline, ids: list[int], method: str, max_new: int):
    """One generation of exactly `max_new` tokens (no stop tokens)."""
    proposer = pipe.proposer(method)
    block = pipe.drafter.cfg.block_size if proposer is not None else 1
    return generate(pipe.target, ids, proposer=proposer, block_size=block, max_new_tokens=max_new)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", default=None, help="default: the shipped one")
    ap.add_argument("--lengths", default="128,2048", help="new tokens of the dflow runs, comma-separated")
    ap.add_argument("--ar-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lengths = [int(n) for n in args.lengths.split(",")]
    pipe = Pipeline.load("smollm2-135m", args.drafter, "bfloat16", device="cpu")
    ids = pipe.encode(PROMPT)
    decode(pipe, ids, "dflow", 16)  # warm-up
    rounds = {n: [] for n in lengths}
    ar_tokens, ar_s = 0, 0.0
    for _ in range(args.repeats):
        for n in lengths:
            rounds[n].append(decode(pipe, ids, "dflow", n).rounds)
        r = decode(pipe, ids, "ar", args.ar_tokens)
        ar_tokens, ar_s = ar_tokens + sum(x.committed for x in r.rounds), ar_s + r.decode_s
    split = {n: metrics.time_split(samples) for n, samples in rounds.items()}
    for n, s in split.items():
        print(f"dflow {n:5d} new tokens: round {s['total']:.2f} ms (draft {s['draft']:.2f}, relay {s['relay']:.2f}, "
              f"verify {s['verify']:.2f}, bookkeeping {s['bookkeeping']:.2f}), tau {metrics.tau(rounds[n]):.3f}")
    first, last = split[lengths[0]], split[lengths[-1]]
    print(f"round time at {lengths[-1]} / at {lengths[0]} new tokens: {last['total'] / first['total']:.3f} "
          f"(bar <= 1.05); draft part alone: {last['draft'] / first['draft']:.3f}")
    print(f"ar: {metrics.tokens_per_s(ar_tokens, ar_s):.2f} tokens/s decode at {args.ar_tokens} new tokens")


if __name__ == "__main__":
    main()
