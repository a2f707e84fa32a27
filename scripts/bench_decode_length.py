"""Does a decode round get slower as the output grows? (issue 15's bar), printed in one run.

    python scripts/bench_decode_length.py [--short 128] [--long 2048] [--short-runs 6] [--ar-tokens 256]

On the default target (bf16) and the shipped drafter, one prompt, stop tokens ignored so every run
reaches its length:
  - `dflow` mean round time (draft + relay + verify + bookkeeping, ms) of a `--long` generation and
    of `--short` ones, with the split, and their ratio (bar: long <= 1.05 x short), for the whole
    round and for its draft part (the drafter and its context cache). The short generations run
    *between* the long one's rounds (from its commit callback, outside its timed stages), spread
    over it, so that the load of a shared machine hits both alike;
  - `ar` decode tokens/s at `--ar-tokens` new tokens (run this script before and after a change).
"""

from __future__ import annotations

import argparse

import torch

from dflow import metrics
from dflow.engine import generate
from dflow.pipeline import Pipeline

PROMPT = "Write a long story about a lighthouse keeper and the ships she guides, chapter by chapter."


def decode(pipe: Pipeline, ids: list[int], method: str, max_new: int, on_commit=None):
    """One generation of exactly `max_new` tokens (no stop tokens)."""
    proposer = pipe.proposer(method)
    block = pipe.drafter.cfg.block_size if proposer is not None else 1
    return generate(pipe.target, ids, proposer=proposer, block_size=block, max_new_tokens=max_new,
                    on_commit=on_commit)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--short", type=int, default=128, help="new tokens of the short dflow runs")
    ap.add_argument("--long", type=int, default=2048, help="new tokens of the long dflow run")
    ap.add_argument("--short-runs", type=int, default=6)
    ap.add_argument("--ar-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    pipe = Pipeline.load("smollm2-135m", None, "bfloat16", device="cpu")
    ids = pipe.encode(PROMPT)
    decode(pipe, ids, "dflow", 16)  # warm-up

    short_rounds, committed = [], [0]
    every = args.long // (args.short_runs + 1)  # long-run tokens between two short runs

    def between_rounds(new_ids: list[int]) -> None:
        committed[0] += len(new_ids)
        if committed[0] >= every * (len(short_rounds) + 1) and len(short_rounds) < args.short_runs:
            short_rounds.append(decode(pipe, ids, "dflow", args.short).rounds)

    long_rounds = decode(pipe, ids, "dflow", args.long, between_rounds).rounds
    ar = decode(pipe, ids, "ar", args.ar_tokens)

    split = {args.short: metrics.time_split(short_rounds), args.long: metrics.time_split([long_rounds])}
    taus = {args.short: metrics.tau(short_rounds), args.long: metrics.tau([long_rounds])}
    for n, s in split.items():
        print(f"dflow {n:5d} new tokens: round {s['total']:.2f} ms (draft {s['draft']:.2f}, relay {s['relay']:.2f}, "
              f"verify {s['verify']:.2f}, bookkeeping {s['bookkeeping']:.2f}), tau {taus[n]:.3f}")
    short, long = split[args.short], split[args.long]
    print(f"round time at {args.long} / at {args.short} new tokens: {long['total'] / short['total']:.3f} "
          f"(bar <= 1.05); draft part alone: {long['draft'] / short['draft']:.3f}")
    print(f"ar: {ar.tokens_per_s:.2f} tokens/s decode at {args.ar_tokens} new tokens")


if __name__ == "__main__":
    main()
