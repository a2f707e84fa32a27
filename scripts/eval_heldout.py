"""Held-out tau of a saved drafter, exactly as `dflow train` measures it during a run (the engine,
greedy, on the data folder's last --held-out conversations), for a snapshot taken between the
run's own evaluations (e.g. issue 18's 2-core-hour mark):

    OMP_NUM_THREADS=1 taskset -c 1 python scripts/eval_heldout.py DRAFTER --data DIR [--held-out 24] \
        [--tokens 64] [--max-len 1536] [--dtype bfloat16] [--method dflash|dflow]
"""

from __future__ import annotations

import argparse
import json

import torch

from dflow.model import load_drafter
from dflow.targets import DEFAULT_TARGET, load_target
from dflow.train.dataset import load_train_data
from dflow.train.logs import held_out_tau


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("drafter")
    p.add_argument("--data", required=True)
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--held-out", type=int, default=24)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--max-len", type=int, default=1536)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--method", choices=("dflash", "dflow"), default="dflash")
    args = p.parse_args()
    target, tokenizer = load_target(args.target, args.dtype, "cpu")
    data = load_train_data(args.data, target, tokenizer, args.max_len, args.held_out)
    drafter = load_drafter(args.drafter, torch.float32)
    rec = held_out_tau(drafter, target, tokenizer, data.held_out, args.method == "dflow", args.tokens)
    print(json.dumps({"drafter": args.drafter, "held_out": len(data.held_out), "tokens": args.tokens, **rec}))


if __name__ == "__main__":
    main()
