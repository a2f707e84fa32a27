"""Anchors a sequence, by gradient noise per core-second: is a denser draw of blocks from each target
context forward worth its drafter cost?

    OMP_NUM_THREADS=1 taskset -c 1 python scripts/probe_anchor_noise.py results/base-2k3 \
        --data data/smollm2-135m-sharegpt-16k --anchors 128,512 --micro 24 [--json out.json]

Each micro-batch draws `--batch-size` random training sequences; one target context forward serves
every anchor count (paired: the same sequences), and for each count the drafter's loss gradient
(k = 0, the drafter's block size, the run's loss) is taken with anchors drawn as `dflow train`
draws them. Per count it prints the blocks a micro-batch, its cost in CPU seconds (the shared
context forward plus the count's drafter forward and backward; the first micro-batch, which
compiles, is not timed), the trace of the gradients' covariance over micro-batches (`noise`), and
noise x cost: the core-seconds needed for a mean gradient of a given noise, the lower the better.
The ratio of two counts' noise x cost is how many times fewer core-seconds the better one needs for
the same gradient quality (SGD at a small rate is noise-limited: McCandlish et al. 2018, "An
empirical model of large-batch training"). The cosine between the counts' mean gradients says
whether they pull the same way.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

import torch

from dflow.model import load_drafter
from dflow.targets import DEFAULT_TARGET, load_target
from dflow.train.batching import anchor_candidates, collate, sample_anchors
from dflow.train.dataset import load_train_data
from dflow.train.rollout import Rollout, TargetParts, context_forward


@dataclass
class Moments:
    """Running sums of flattened gradients g_i and of |g_i|^2, for their mean and covariance trace."""

    total: torch.Tensor | None = None
    sq: float = 0.0
    n: int = 0

    def add(self, g: torch.Tensor) -> None:
        self.total = g.clone() if self.total is None else self.total + g
        self.sq += float(g.square().sum())
        self.n += 1

    @property
    def mean(self) -> torch.Tensor:
        return self.total / self.n

    def noise(self) -> float:
        """Unbiased trace of the covariance: (sum |g_i|^2 - n |mean|^2) / (n - 1)."""
        return (self.sq - self.n * float(self.mean.square().sum())) / (self.n - 1)


def probe(target, drafter, data, counts: list[int], micro: int, batch_size: int, seed: int) -> dict[int, dict]:
    """-> per anchor count: blocks and CPU-seconds a micro-batch (shared context forward + its drafter pass;
    the first micro-batch, which compiles, untimed), gradient noise, |mean|^2, noise x cost, and the mean
    gradient ("mean", a tensor)."""
    rollout = Rollout(drafter, TargetParts(target, drafter.cfg.target_layer_ids), 0, False, compile=True, loss_gamma=1.0)
    params = [q for q in drafter.parameters() if q.requires_grad]
    gen = torch.Generator().manual_seed(seed)
    moments = {n: Moments() for n in counts}
    blocks, drafter_s, context_s = dict.fromkeys(counts, 0), dict.fromkeys(counts, 0.0), 0.0
    for i in range(micro):
        seqs = [data[j] for j in torch.randint(len(data), (batch_size,), generator=gen).tolist()]
        draws = {n: [sample_anchors(mask, n, torch.Generator().manual_seed(seed * 7919 + i * 101 + k))
                     for k, (_, mask) in enumerate(seqs)] for n in counts}
        c0 = time.process_time()
        ids = collate(seqs, draws[counts[0]]).ids
        features, _ = context_forward(target, ids, drafter.cfg.target_layer_ids, keep_cache=False)
        context_s += (time.process_time() - c0) if i else 0.0
        for n in counts:
            batch = collate(seqs, draws[n])
            c0 = time.process_time()
            drafter.zero_grad(set_to_none=True)
            loss, _ = rollout(batch, features, None)
            loss.backward()
            moments[n].add(torch.cat([q.grad.flatten() for q in params]))
            drafter_s[n] += (time.process_time() - c0) if i else 0.0
            blocks[n] += int(batch.live.sum())
        done = ", ".join(f"{n}: {blocks[n]} blocks" for n in counts)
        print(f"micro-batch {i + 1}/{micro}: {done}", flush=True)
    ctx = context_s / (micro - 1)
    rows = {}
    for n, m in moments.items():
        cost = ctx + drafter_s[n] / (micro - 1)
        rows[n] = {"blocks_per_micro": blocks[n] / micro, "cost_s": cost, "context_s": ctx,
                   "drafter_s": drafter_s[n] / (micro - 1), "noise": m.noise(),
                   "mean_grad_sq": float(m.mean.square().sum()), "noise_x_cost": m.noise() * cost, "mean": m.mean}
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("drafter")
    p.add_argument("--data", required=True)
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--anchors", default="128,512", help="anchors a sequence to compare, comma-separated")
    p.add_argument("--micro", type=int, default=24, help="micro-batches (gradient samples) per count")
    p.add_argument("--batch-size", type=int, default=2, help="sequences a micro-batch")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-len", type=int, default=1536)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    counts = [int(a) for a in args.anchors.split(",")]
    if args.micro < 3:
        p.error("--micro must be >= 3 (the first compiles and is not timed; a variance needs two more)")

    target, tokenizer = load_target(args.target, args.dtype, torch.device("cpu"))
    data = load_train_data(args.data, target, tokenizer, args.max_len, 24).train  # held-out slice as `dflow train`'s
    drafter = load_drafter(args.drafter).train()
    cands = torch.tensor([int(anchor_candidates(mask).sum()) for _, mask in data], dtype=torch.float)  # [sequences]
    drawn = ", ".join(f"{n}: {float(cands.clamp(max=n).sum() / cands.sum()):.0%}" for n in counts)
    print(f"anchor candidates a training sequence: {float(cands.mean()):.0f} on average; share drawn: {drawn}")
    rows = probe(target, drafter, data, counts, args.micro, args.batch_size, args.seed)
    base = rows[counts[0]]
    print(f"\n{args.micro} micro-batches of {args.batch_size} sequences, {args.drafter}, {args.dtype}; context "
          f"forward {base['context_s']:.2f} CPU-s a micro-batch (shared)")
    print("| anchors a sequence | blocks a micro-batch | CPU-s a micro-batch | gradient noise (trace) | |mean grad|^2 "
          "| noise x cost | core-s for equal noise vs the first |")
    print("|---|---|---|---|---|---|---|")
    for n, r in rows.items():
        print(f"| {n} | {r['blocks_per_micro']:.0f} | {r['cost_s']:.2f} | {r['noise']:.4g} | {r['mean_grad_sq']:.3g} "
              f"| {r['noise_x_cost']:.4g} | {r['noise_x_cost'] / base['noise_x_cost']:.2f}x |")
    for n in counts[1:]:
        rows[n]["cosine_to_first"] = float(torch.nn.functional.cosine_similarity(base["mean"], rows[n]["mean"], dim=0))
        print(f"cosine of the mean gradients, {counts[0]} vs {n}: {rows[n]['cosine_to_first']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": vars(args), "rows": {str(n): {k: v for k, v in r.items() if k != "mean"}
                                                       for n, r in rows.items()}}, f, indent=2)


if __name__ == "__main__":
    main()
