"""Which process trains on which sequences, with which anchors, at each step.

The data order (a permutation per epoch) and every sequence's anchors are pure functions of
(seed, epoch, sequence index): a resumed run, or a run split over N processes with the same
global batch, sees exactly the batches of an uninterrupted single-process run. Global batch per
optimizer step = batch_size * grad_accum * world_size sequences; process r takes slice r of
each micro-step's share.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dflow.errors import DFlowError
from dflow.targets import resolve_device
from dflow.train.batching import Batch, collate, sample_anchors
from dflow.train.config import TrainConfig
from dflow.train.dataset import Example


@dataclass(frozen=True)
class Dist:
    """This process's place in a (possibly single-process) run; torchrun sets the environment."""

    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def main(self) -> bool:
        return self.rank == 0

    @classmethod
    def setup(cls, device: str = "auto") -> "Dist":
        """`device` as `--device` takes it; under torchrun, CUDA means this process's local GPU."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        chosen = resolve_device(device)
        if world == 1:
            return cls(device=chosen)
        cuda = chosen.type == "cuda"
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if cuda:
            torch.cuda.set_device(local)
        dist.init_process_group("nccl" if cuda else "gloo")
        return cls(dist.get_rank(), world, torch.device(f"cuda:{local}" if cuda else "cpu"))

    def close(self) -> None:
        if self.world > 1 and dist.is_initialized():
            dist.destroy_process_group()


class DataOrder:
    """Which sequences (and anchors) a process trains on at each step."""

    def __init__(self, data: list[Example], cfg: TrainConfig, env: Dist):
        self.data, self.cfg, self.env = data, cfg, env
        self.global_batch = cfg.batch_size * cfg.grad_accum * env.world
        self.steps_per_epoch = len(data) // self.global_batch
        if self.steps_per_epoch == 0:
            raise DFlowError(f"{len(data)} training sequences are fewer than one global batch of {self.global_batch} "
                             f"(--batch-size x --grad-accum x processes)")
        self._perm: tuple[int, torch.Tensor] | None = None

    def indices(self, step: int) -> tuple[int, list[int]]:
        """-> (epoch, the global batch's sequence indices) of `step`."""
        epoch, k = divmod(step, self.steps_per_epoch)
        if self._perm is None or self._perm[0] != epoch:
            gen = torch.Generator().manual_seed(self.cfg.seed * 100_003 + epoch)
            self._perm = (epoch, torch.randperm(len(self.data), generator=gen))
        return epoch, self._perm[1][k * self.global_batch:(k + 1) * self.global_batch].tolist()

    def members(self, step: int, micro: int) -> list[int]:
        """Indices (into the training list) of this process's micro-batch `micro` of `step`."""
        start = (micro * self.env.world + self.env.rank) * self.cfg.batch_size
        return self.indices(step)[1][start:start + self.cfg.batch_size]

    def batch(self, step: int, micro: int) -> Batch:
        """This process's micro-batch `micro` of `step`, anchors sampled per (seed, epoch, sequence)."""
        epoch, mine = self.indices(step)[0], self.members(step, micro)
        seqs = [self.data[i] for i in mine]
        gens = [torch.Generator().manual_seed(((self.cfg.seed * 1_000_003 + epoch) * 1_000_003 + i) % 2**63)
                for i in mine]
        return collate(seqs, [sample_anchors(mask, self.cfg.anchors_per_seq, g) for (_, mask), g in zip(seqs, gens)])

    def num_tokens(self, step: int) -> int:
        return sum(len(self.data[i][0]) for i in self.indices(step)[1])
