"""Training step cost on the default target: DFlash (k = 0) vs DFlow (k = 2), printed.

    python scripts/bench_train.py [--data DIR] [--steps 2] [--batch-size 2] [--anchors-per-seq 16]

Same batch, same anchors, same drafter initialisation for both; a warm-up step, then `--steps`
timed steps. Prints trajectory tokens/s of each, the DFlow/DFlash step-cost ratio (bar: <= 6x)
and where the time goes: target context forward, drafter rounds (forward, relay and losses),
verifier passes, backward, optimizer. Without --data (or with an empty folder) it uses random
token sequences of --seq-len tokens (supervised after the first quarter): the cost is the same.
"""

from __future__ import annotations

import argparse
import time

import torch

from dflow.pipeline import init_drafter
from dflow.targets import DEFAULT_TARGET, load_target
from dflow.train.batching import collate, sample_anchors
from dflow.train.dataset import load_train_data
from dflow.train.rollout import Rollout, TargetParts, context_forward


def sequences(args, target, tokenizer):
    if args.data:
        data = load_train_data(args.data, target, tokenizer, args.seq_len, held_out=0)
        return data.train[: args.batch_size], "data " + args.data
    g = torch.Generator().manual_seed(0)
    seqs = []
    for _ in range(args.batch_size):
        mask = torch.zeros(args.seq_len, dtype=torch.bool)
        mask[args.seq_len // 4:] = True
        seqs.append((torch.randint(0, target.config.vocab_size, (args.seq_len,), generator=g), mask))
    return seqs, f"random sequences of {args.seq_len} tokens"


def bench(target, tokenizer, batch, args, rounds: int) -> dict:
    drafter = init_drafter(target, tokenizer, args.layers, args.block_size, seed=0, relay=rounds > 0).train()
    rollout = Rollout(drafter, TargetParts(target, drafter.cfg.target_layer_ids), rounds, use_relay=True)
    opt = torch.optim.AdamW(drafter.parameters(), lr=6e-4)
    parts = dict.fromkeys(("context", "drafter", "verify", "backward", "optimizer"), 0.0)
    for step in range(args.steps + 1):  # step 0 warms up
        rollout.verify_s = 0.0
        t0 = time.perf_counter()
        features, cache = context_forward(target, batch.ids, drafter.cfg.target_layer_ids, keep_cache=rounds > 0)
        t1 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            loss, _ = rollout(batch, features, cache)
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t4 = time.perf_counter()
        if step:
            for k, v in zip(parts, (t1 - t0, t2 - t1 - rollout.verify_s, rollout.verify_s, t3 - t2, t4 - t3)):
                parts[k] += v / args.steps
    parts["step"] = sum(parts.values())
    parts["tokens_per_s"] = batch.num_tokens / parts["step"]
    return parts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--data", default=None, help="a `dflow data` folder (default: random sequences)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--anchors-per-seq", type=int, default=16)
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16", help="the target's weights")
    p.add_argument("--bf16", action="store_true", help="bfloat16 autocast for the drafter")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target, tokenizer = load_target(args.target, args.dtype)
    seqs, source = sequences(args, target, tokenizer)
    g = torch.Generator().manual_seed(0)
    batch = collate(seqs, [sample_anchors(mask, args.anchors_per_seq, g) for _, mask in seqs])
    print(f"{args.target} ({args.dtype}, drafter autocast {'bf16' if args.bf16 else 'off'}), {source}: "
          f"{len(seqs)} sequences, {batch.num_tokens} tokens, {int(batch.live.sum())} anchors, block "
          f"{args.block_size}, {args.layers} drafter layers, {torch.get_num_threads()} threads, {args.steps} steps")
    results = {name: bench(target, tokenizer, batch, args, k) for name, k in (("DFlash k=0", 0), ("DFlow k=2", 2))}
    cols = ("context", "drafter", "verify", "backward", "optimizer", "step")
    print(f"{'ms per step':<12}" + "".join(f"{c:>11}" for c in cols) + f"{'tokens/s':>11}")
    for name, r in results.items():
        print(f"{name:<12}" + "".join(f"{1000 * r[c]:>11.0f}" for c in cols) + f"{r['tokens_per_s']:>11.0f}")
    ratio = results["DFlow k=2"]["step"] / results["DFlash k=0"]["step"]
    print(f"DFlow / DFlash step cost: {ratio:.2f}x (bar: <= 6x) {'OK' if ratio <= 6 else 'OVER'}")


if __name__ == "__main__":
    main()
