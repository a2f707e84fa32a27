"""Count the torch operations of one training step (DFlash, the default target and data, bf16) with
a CPU's attention and loss chunks, with a GPU's (dflow.train.rollout.chunk_size), and with a GPU's
and its dense drafter attention (`Rollout.dense`, what a GPU runs), on the CPU:
on a GPU each operation that is not a view is a kernel launch or more, so the count is what a step
costs there beyond its arithmetic (docs/training.md, "On a GPU").

    OMP_NUM_THREADS=1 python scripts/count_train_ops.py --batches 2 8
"""

from __future__ import annotations

import argparse
import shutil
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

from dflow.train import rollout
from dflow.train.config import TrainConfig
from dflow.train.loop import Trainer
from dflow.train.sharding import Dist


LAYOUTS = {"cpu": "a CPU's chunks", "gpu-chunked": "a GPU's chunks", "gpu": "a GPU's (dense drafter attention)"}


def step_ops(batch: int, layout: str, data: str, init: str, top: int = 0) -> int:
    """Operations of the second step (the first warms up) at `batch` sequences, in `layout` (LAYOUTS)."""
    sized = rollout.chunk_size
    if layout != "cpu":
        rollout.chunk_size = lambda tokens, device: sized(tokens, torch.device("cuda"))
    out = tempfile.mkdtemp()
    try:
        cfg = TrainConfig(target="smollm2-135m", data=data, out=out, init=init, rounds=0, batch_size=batch,
                          block_bias=0.0, max_len=1536, max_steps=100, warmup=40, eval_samples=0, device="cpu",
                          layout="dense" if layout == "gpu" else "chunked")  # "gpu": what --layout auto runs on CUDA
        trainer = Trainer(cfg, Dist.setup("cpu"), progress=False)
        trainer.train_step(0)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            trainer.train_step(1)
        events = sorted(prof.key_averages(), key=lambda e: -e.count)
        if top:
            print(f"batch {batch}, {LAYOUTS[layout]}: the {top} most frequent operations")
            for e in events[:top]:
                print(f"  {e.count:7d}  {e.key}")
        return sum(e.count for e in events)
    finally:
        rollout.chunk_size = sized
        shutil.rmtree(out, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--data", default="data/smollm2-135m-sharegpt-16k")
    ap.add_argument("--init", default="results/base-run")
    ap.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    ap.add_argument("--top", type=int, default=0, help="also list each layout's N most frequent operations")
    args = ap.parse_args()
    for batch in args.batches:
        counts = [f"{step_ops(batch, layout, args.data, args.init, args.top)} with {LAYOUTS[layout]}" for layout in args.layouts]
        print(f"batch {batch}: operations a step: " + ", ".join(counts), flush=True)


if __name__ == "__main__":
    main()
