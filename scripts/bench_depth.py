"""What a decode round costs for each drafter depth and block size, and so what tau each needs to
beat plain decoding (issue 14: choose depth and block size by measured decode speed, not tau alone).

    OMP_NUM_THREADS=1 taskset -c 1 python scripts/bench_depth.py [--layers 1,2,3,5] [--blocks 4,8,16] \
        [--tokens 48] [--repeats 3] [--json FILE]

On the default target in bf16, one prompt, stop tokens ignored: for each (drafter layers, block
size) a freshly initialised DFlash drafter (5 fused target layers, the 8K draft vocabulary) decodes
`--tokens` new tokens with `dflash`; a round's cost does not depend on what it accepts (the
verification is one forward of the whole block), so an untrained drafter times it. `ar` runs
through the same engine, interleaved. Per cell: the mean round time (ms) with its draft share, and
the tau at which `dflow` would run at 1.0x, 1.4x and 2.0x `ar` (tau x ar ms/token / round ms);
best of `--repeats` interleaved passes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from dflow import metrics
from dflow.engine import generate
from dflow.pipeline import Pipeline, init_drafter
from dflow.proposers import proposer_for

PROMPT = "Explain, step by step, how a lighthouse keeper plans the nightly watch and the ships she guides."


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="1,2,3,5")
    ap.add_argument("--blocks", default="4,8,16")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    pipe = Pipeline.load("smollm2-135m", None, "bfloat16", need_drafter=False, device="cpu")
    ids = pipe.encode(PROMPT)
    vocab = torch.arange(8192)  # the cost of an 8K draft vocabulary (which ids does not matter here)
    layers, blocks = [int(x) for x in args.layers.split(",")], [int(x) for x in args.blocks.split(",")]
    drafters = {L: init_drafter(pipe.target, pipe.tokenizer, L, max(blocks), target_layers=5, draft_vocab=vocab)
                .to(torch.bfloat16).eval() for L in layers}
    best: dict = {}

    def keep(key, value):
        best[key] = min(best.get(key, value), value)

    for _ in range(args.repeats + 1):  # the first pass warms up
        ar = generate(pipe.target, ids, max_new_tokens=args.tokens)
        keep("ar", 1000.0 / ar.tokens_per_s)
        for L in layers:
            for B in blocks:
                res = generate(pipe.target, ids, proposer=proposer_for("dflash", drafters[L], pipe.target), block_size=B,
                               max_new_tokens=args.tokens)
                split = metrics.time_split([res.rounds])
                keep((L, B), split["total"])
                keep((L, B, "draft"), split["draft"])
    rows = []
    ar_ms = best["ar"]
    print(f"ar: {ar_ms:.2f} ms/token ({1000 / ar_ms:.1f} tokens/s)")
    print("| drafter layers | block | round ms | draft ms | tau for 1.0x / 1.4x / 2.0x ar |")
    print("|---|---|---|---|---|")
    for L in layers:
        for B in blocks:
            r, d = best[(L, B)], best[(L, B, "draft")]
            need = [x * r / ar_ms for x in (1.0, 1.4, 2.0)]
            rows.append({"layers": L, "block": B, "round_ms": r, "draft_ms": d, "tau_needed": need})
            print(f"| {L} | {B} | {r:.1f} | {d:.1f} | {' / '.join(f'{n:.2f}' for n in need)} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"ar_ms_per_token": ar_ms, "cells": rows, "args": vars(args)}, indent=2) + "\n")


if __name__ == "__main__":
    main()
