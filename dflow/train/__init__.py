"""Drafter training: DFlash (round 0) and DFlow's multi-round self-conditioned training.

    batching.py    anchors, packed-block masks, labels, loss weights (no models)
    rollout.py     context forward, drafter rounds, transition, packed verifier pass, relay inputs
    dataset.py     a `dflow data` folder as checked, truncated training sequences
    checkpoint.py  atomic checkpoints without pickles; resume
    config.py      the run's settings and their validation
    sharding.py    processes (torchrun) and the deterministic data order / anchors
    logs.py        per-step records, metrics.jsonl, held-out tau with the real engine
    loop.py        drafter to start from, optimizer, schedule, DDP, micro-steps, NaN guard
    __main__.py    `torchrun --nproc_per_node N -m dflow.train ...`
"""

from dflow.train.config import TrainConfig
from dflow.train.loop import train

__all__ = ["TrainConfig", "train"]
