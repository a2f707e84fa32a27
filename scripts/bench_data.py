"""Benchmark `dflow data`'s engines on the same conversations, in one run: generated tokens/s of
HF `generate` (at each batch size asked) and of vLLM, and how many replies are token-identical.

    .venv-vllm/bin/python scripts/bench_data.py --num-conversations 64 --max-new-tokens 256 --max-len 1024 \
        --hf-batch-sizes 8,16 --cpus 0

Each engine builds the same planned conversations (same seed, settings, dtype) into a temporary
folder; tokens/s is assistant tokens over the time spent generating (engine start-up excluded,
reported separately as wall time). bf16 numerics differ between engines, so greedy replies can
part ways: the share of identical replies is reported, not hidden. Prints one line per engine and
a summary line; `--json` writes the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from dflow.data import DataConfig, build_dataset, open_dataset
from dflow.targets import DEFAULT_TARGET


def replies(folder: Path) -> list[list[list[int]]]:
    """Per conversation, its reply spans (ids under the loss mask)."""
    out = []
    for ids, mask in open_dataset(folder):
        spans, cur = [], None
        for t, m in zip(ids.tolist(), mask.tolist()):
            if m:
                cur = cur if cur is not None else []
                cur.append(t)
            elif cur is not None:
                spans.append(cur)
                cur = None
        out.append(spans + ([cur] if cur is not None else []))
    return out


def identical(a: list[list[list[int]]], b: list[list[list[int]]]) -> tuple[int, int, int]:
    """(identical replies, replies compared, identical whole conversations); replies are compared
    turn by turn until the conversations part ways (after that their prompts differ)."""
    same = total = convs = 0
    for x, y in zip(a, b):
        convs += x == y
        for rx, ry in zip(x, y):
            total += 1
            same += rx == ry
            if rx != ry:
                break
    return same, total, convs


def run(cfg: DataConfig, out: Path) -> dict:
    start = time.perf_counter()
    meta = build_dataset(cfg, out, progress=False)
    wall = time.perf_counter() - start
    c = meta["counts"]
    return {"engine": cfg.engine, "batch_size": cfg.batch_size, "assistant_tokens": c["assistant_tokens"],
            "generate_s": meta["generate_s"], "tokens_per_s": meta["generated_tokens_per_s"], "wall_s": round(wall, 1),
            "version": meta["engine"]["version"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--num-conversations", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--hf-batch-sizes", default="8,16", help="comma-separated; the best one is compared")
    p.add_argument("--vllm-batch-size", type=int, default=256)
    p.add_argument("--cpus", default=None, help="cores both engines run on, e.g. 0 or 0-1 (HF: torch threads)")
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args()
    if args.cpus:  # both engines on the same cores
        cores = sorted({int(c) for part in args.cpus.split(",") for c in
                        (range(int(part.split("-")[0]), int(part.split("-")[-1]) + 1))})
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))
    base = DataConfig(target=args.target, num_conversations=args.num_conversations, max_len=args.max_len,
                      max_new_tokens=args.max_new_tokens, dtype=args.dtype, shard_size=args.num_conversations,
                      cpus=args.cpus)
    results, folders = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for bs in [int(b) for b in args.hf_batch_sizes.split(",")]:
            folders[f"hf{bs}"] = Path(tmp) / f"hf{bs}"
            results.append(run(replace(base, engine="hf", batch_size=bs), folders[f"hf{bs}"]))
        folders["vllm"] = Path(tmp) / "vllm"
        results.append(run(replace(base, engine="vllm", batch_size=args.vllm_batch_size), folders["vllm"]))
        hf_best = max((r for r in results if r["engine"] == "hf"), key=lambda r: r["tokens_per_s"])
        vllm = results[-1]
        same, total, convs = identical(replies(folders[f"hf{hf_best['batch_size']}"]), replies(folders["vllm"]))
    for r in results:
        print(f"{r['engine']:>4} {r['version']} batch {r['batch_size']:>3}: {r['assistant_tokens']} tokens in "
              f"{r['generate_s']:.1f} s = {r['tokens_per_s']:.1f} generated tokens/s (wall {r['wall_s']:.1f} s)")
    ratio = vllm["tokens_per_s"] / hf_best["tokens_per_s"]
    print(f"dflow data engines | {args.target} {args.dtype}, {args.num_conversations} conversations, max-new-tokens "
          f"{args.max_new_tokens}, max-len {args.max_len}, cores {args.cpus or 'all'} | vllm {vllm['tokens_per_s']:.1f} "
          f"vs hf (batch {hf_best['batch_size']}) {hf_best['tokens_per_s']:.1f} generated tokens/s: {ratio:.1f}x | "
          f"token-identical replies {same}/{total}, whole conversations {convs}/{args.num_conversations}")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "vllm_over_hf": round(ratio, 2),
                                               "identical_replies": [same, total],
                                               "identical_conversations": [convs, args.num_conversations],
                                               "args": vars(args)}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
