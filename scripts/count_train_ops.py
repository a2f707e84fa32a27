"""Count the torch operations of one training step (DFlash, the default target and data, bf16) with
a CPU's attention and loss chunks and with a GPU's (dflow.train.rollout.chunk_size), on the CPU:
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


def step_ops(batch: int, gpu_chunks: bool, data: str, init: str) -> int:
    """Operations of the second step (the first warms up) at `batch` sequences."""
    sized = rollout.chunk_size
    if gpu_chunks:
        rollout.chunk_size = lambda tokens, device: sized(tokens, torch.device("cuda"))
    out = tempfile.mkdtemp()
    try:
        cfg = TrainConfig(target="smollm2-135m", data=data, out=out, init=init, rounds=0, batch_size=batch,
                          block_bias=0.0, max_len=1536, max_steps=100, warmup=40, eval_samples=0, device="cpu")
        trainer = Trainer(cfg, Dist.setup("cpu"), progress=False)
        trainer.train_step(0)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            trainer.train_step(1)
        return sum(e.count for e in prof.key_averages())
    finally:
        rollout.chunk_size = sized
        shutil.rmtree(out, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--data", default="data/smollm2-135m-sharegpt-16k")
    ap.add_argument("--init", default="results/base-run")
    args = ap.parse_args()
    for batch in args.batches:
        cpu, gpu = (step_ops(batch, g, args.data, args.init) for g in (False, True))
        print(f"batch {batch}: {cpu} operations a step with a CPU's chunks, {gpu} with a GPU's")


if __name__ == "__main__":
    main()
