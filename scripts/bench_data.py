"""Benchmark `dflow data` on the default target: generated tokens/s and peak memory.

    .venv/bin/python scripts/bench_data.py --num-conversations 16 --max-new-tokens 64

Runs the real command into a temporary folder (nothing is resumed) and prints one line.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

from dflow.cli import main as dflow_main
from dflow.targets import DEFAULT_TARGET


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--num-conversations", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (1 is much faster on cores shared with other jobs)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    passed = ("target", "num_conversations", "max_new_tokens", "max_len", "batch_size", "dtype")
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        code = dflow_main(["data", "--out", out] + [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in passed])
        wall = time.perf_counter() - start
        if code:
            return code
        meta = json.loads((Path(out) / "meta.json").read_text())
    c = meta["counts"]
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    print(f"dflow data bench | {args.target} {args.dtype} batch {args.batch_size}, {torch.get_num_threads()} threads | "
          f"{c['conversations']} conversations, "
          f"{c['assistant_tokens']} generated tokens in {meta['generate_s']:.1f} s: "
          f"{meta['generated_tokens_per_s']:.1f} generated tokens/s | {c['tokens']} tokens written | "
          f"wall {wall:.1f} s | peak RSS {peak_mb:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
