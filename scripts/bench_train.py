"""Training cost per block: today's recipe against the new one, k = 0 and k = 2, in one run.

    python scripts/bench_train.py --data data/smollm2-135m-sharegpt-3000 [--steps 2] [--batch-size 4]
        [--today-anchors 32] [--new-anchors 512] [--sweep 32,128,512] [--no-compile]

Same sequences, drafter size and initialisation for every recipe; one warm-up step each, then
`--steps` timed steps, the recipes' steps interleaved so that a noisy machine slows them alike.
The recipes are a ladder, one lever more per rung (`ladder`): today's (`dflow train`'s defaults:
float32, 32 anchors a sequence, one dense block mask, full-vocabulary fp32 logits, i.e.
`Rollout(reference=True)`), bf16, the linear layout (chunked block attention, verifier pass and
head + loss), dense anchors, compiled layers: the new recipe. Per recipe and k it prints blocks/s
per core (a block is one anchor's whole rollout), each phase's share (target context forward,
drafter rounds, verifier passes, backward, optimizer), the step's peak memory (and above the
resident set before it), its useful GFLOP/s (`useful_flops`) beside a plain matmul's rate, and
the per-block cost against today's, with and without the context forward (a feature cache takes
it off the step); `--sweep`: drafter cost per block against anchors a sequence, dense vs linear.
Without --data: random sequences of --seq-len tokens (supervised after the first quarter).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import time
from dataclasses import dataclass

import torch

from dflow.pipeline import init_drafter
from dflow.targets import DEFAULT_TARGET, load_target
from dflow.train.batching import collate, sample_anchors
from dflow.train.dataset import load_train_data
from dflow.train import rollout as rollout_module
from dflow.train.rollout import STATS, Rollout, TargetParts, context_forward

PHASES = ("context", "drafter", "verify", "backward", "optimizer")


def clock() -> float:
    """This process's CPU seconds: on a core shared with other jobs, what a step costs the core
    (wall time would count the other jobs' turns too)."""
    return time.process_time()


VERIFY_S = [0.0]  # CPU seconds in verifier passes, summed by the wrappers below


def timed(fn):
    def wrapper(*args, **kwargs):
        t = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            VERIFY_S[0] += clock() - t
    return wrapper


for _name in ("verify_blocks", "verify_chunked"):  # the rollout looks them up at call time
    setattr(rollout_module, _name, timed(getattr(rollout_module, _name)))


@dataclass(frozen=True)
class Recipe:
    name: str
    dtype: str  # the target's weights
    bf16: bool  # bfloat16 autocast for the drafter
    anchors: int  # per sequence
    reference: bool  # the dense layout
    compile: bool = False  # torch.compile the drafter's layers


def ladder(args) -> tuple[Recipe, ...]:
    """today's recipe, then one lever more per rung; the last rung is the new recipe."""
    return (Recipe("today", "float32", False, args.today_anchors, True),
            Recipe("bf16", "bfloat16", True, args.today_anchors, True),
            Recipe("linear", "bfloat16", True, args.today_anchors, False),
            Recipe("dense", "bfloat16", True, args.new_anchors, False),
            Recipe("new", "bfloat16", True, args.new_anchors, False, compile=not args.no_compile))


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


def resident_mb() -> tuple[float, float]:
    """(resident set now, its peak since the last `reset_peak`) in MB, from /proc/self/status."""
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return tuple(int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM"))


def reset_peak() -> None:
    """Hand freed heap memory back to the system, then restart the peak count: the resident set
    before a step is then what is live, and the peak above it is the step's own."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset the peak resident set (Linux)
        f.write("5")


class Drafter:
    """The drafter and optimizer every recipe at one k trains (one copy in memory, not one per
    recipe: step cost does not depend on the weights)."""

    def __init__(self, target, tokenizer, rounds: int, args):
        self.model = init_drafter(target, tokenizer, args.layers, args.block_size, seed=0, relay=rounds > 0).train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=6e-4)


class Run:
    """One recipe at one k: its rollout and batch over the k's shared drafter; `step` times a step."""

    def __init__(self, recipe: Recipe, rounds: int, target, drafter: Drafter, seqs):
        self.recipe, self.rounds, self.target = recipe, rounds, target
        g = torch.Generator().manual_seed(0)
        self.batch = collate(seqs, [sample_anchors(mask, recipe.anchors, g) for _, mask in seqs])
        self.drafter, self.opt = drafter.model, drafter.opt
        self.rollout = Rollout(self.drafter, TargetParts(target, self.drafter.cfg.target_layer_ids), rounds,
                               use_relay=True, reference=recipe.reference, compile=recipe.compile)
        self.compiled = self.drafter.dflash.compiled if recipe.compile else None  # shared drafter: set per step
        self.times = {p: [] for p in PHASES}
        self.memory, self.stats = [], None

    @property
    def blocks(self) -> int:
        return int(self.batch.live.sum())

    def step(self, record: bool) -> None:
        self.drafter.dflash.compiled = self.compiled
        reset_peak()
        rss, _ = resident_mb()
        VERIFY_S[0] = 0.0
        t0 = clock()
        features, cache = context_forward(self.target, self.batch.ids, self.drafter.cfg.target_layer_ids,
                                          keep_cache=self.rounds > 0)
        t1 = clock()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.recipe.bf16):
            loss, self.stats = self.rollout(self.batch, features, cache)
        t2 = clock()
        loss.backward()
        t3 = clock()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        t4 = clock()
        if record:
            verify = VERIFY_S[0]
            for p, v in zip(PHASES, (t1 - t0, t2 - t1 - verify, verify, t3 - t2, t4 - t3)):
                self.times[p].append(v)
            self.memory.append((resident_mb()[1], rss))

    def summary(self) -> dict:
        mean = {p: sum(v) / len(v) for p, v in self.times.items()}
        step = sum(mean.values())
        peak, before = max(self.memory)
        return {**mean, "step": step, "peak": peak, "extra": peak - before,
                "flops": useful_flops(self.target.config, self.drafter.cfg, self.batch, self.stats)}


def useful_flops(tc, dc, batch, stats) -> float:
    """FLOPs a step must do, from the shapes (masked-out or padded work not counted): matmuls
    (2 per multiply-add) of the target's context forward over the real tokens, of the drafter's
    context projection (forward + backward = 3x), of every live block in every round (drafter
    layers 3x; the frozen head 2x: forward and the input gradient; attention to its context and
    itself, at the batch's mean anchor, 3x) and of the verifier passes (forward only)."""
    H, L, B = tc.hidden_size, tc.num_hidden_layers, dc.block_size
    hd = dc.head_dim

    def layer_macs(inter, heads, kv):  # per token of a decoder layer
        return H * (heads * hd) * 2 + H * (kv * hd) * 2 + 3 * H * inter

    t_layer = layer_macs(tc.intermediate_size, tc.num_attention_heads, tc.num_key_value_heads)
    d_layer = layer_macs(dc.intermediate_size, dc.num_attention_heads, dc.num_key_value_heads)
    lengths = batch.lengths.float()
    attn = 2 * tc.num_attention_heads * hd  # MACs per (query, key) pair per layer: QK and PV
    context = 2 * (t_layer * L * lengths.sum() + attn * L * (lengths ** 2 / 2).sum())
    kv_macs = dc.num_hidden_layers * 2 * H * dc.num_key_value_heads * hd
    projection = 3 * 2 * lengths.sum() * (len(dc.target_layer_ids) * H * H + kv_macs)
    live = stats[:, STATS.index("anchors")]  # [rounds + 1] live blocks per round
    s = batch.anchors[batch.live].float().mean()
    per_block = (3 * 2 * dc.num_hidden_layers * (B * d_layer + B * (s + B) * 2 * dc.num_attention_heads * hd)
                 + 2 * 2 * (B - 1) * H * dc.vocab_size)
    verify = 2 * B * L * (t_layer + attn * (s + B / 2))
    return float(context + projection + live.sum() * per_block + live[:-1].sum() * verify)


def matmul_rate(dtype: torch.dtype, m=2048, k=576, n=1536, seconds=1.0) -> float:
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    a @ b
    t, reps = clock(), 0
    while clock() - t < seconds:
        a @ b
        reps += 1
    return 2 * m * k * n * reps / (clock() - t) / 1e9


def sweep(target, tokenizer, seqs, args, counts, threads):
    """Drafter forward + backward per block (k = 0, context features given) against anchors per
    sequence, on the longest sequence: the dense layout grows faster than linearly, the chunked not."""
    seq = max(seqs, key=lambda s: int(s[1].sum()))
    print(f"\ndrafter forward + backward per block, k = 0, bf16, one sequence of {len(seq[0])} tokens:")
    print(f"{'anchors':>8}{'blocks':>8}{'dense ms':>10}{'linear ms':>11}")
    drafter = Drafter(target, tokenizer, 0, args)
    for n in counts:
        row = []
        for reference in (True, False):
            run = Run(Recipe("", "bfloat16", True, n, reference), 0, target, drafter, [seq])
            features, _ = context_forward(target, run.batch.ids, run.drafter.cfg.target_layer_ids, keep_cache=False)
            best = float("inf")
            for _ in range(2):
                t = clock()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss, _ = run.rollout(run.batch, features, None)
                loss.backward()
                best = min(best, clock() - t)
            row.append(1000 * best * threads / run.blocks)
        print(f"{n:>8}{run.blocks:>8}{row[0]:>10.1f}{row[1]:>11.1f}")


def report(runs: list[Run], threads: int, rates: dict) -> None:
    """The table (a row per recipe and k), the matmul rates, and the new recipe's per-block ratios."""
    print(f"\n{'recipe':<8}{'k':>2}{'blocks':>7}" + "".join(f"{c:>10}" for c in PHASES)
          + f"{'step s':>8}{'ms/block':>9}{'blocks/s/core':>14}{'x today':>8}{'(no ctx)':>9}{'peak MB':>8}"
          f"{'(+step)':>8}{'GFLOP/s':>8}")
    res = {(run.recipe.name, run.rounds): {**run.summary(), "blocks": run.blocks} for run in runs}
    for (name, k), r in res.items():
        today = res["today", k]
        full = (today["step"] / today["blocks"]) / (r["step"] / r["blocks"])
        bare = ((today["step"] - today["context"]) / today["blocks"]) / ((r["step"] - r["context"]) / r["blocks"])
        r["ratios"] = full, bare
        shares = "".join(f"{100 * r[c] / r['step']:>9.0f}%" for c in PHASES)
        print(f"{name:<8}{k:>2}{r['blocks']:>7}{shares}{r['step']:>8.2f}{1000 * r['step'] / r['blocks']:>9.1f}"
              f"{r['blocks'] / r['step'] / threads:>14.2f}{full:>8.1f}{bare:>9.1f}{r['peak']:>8.0f}{r['extra']:>8.0f}"
              f"{r['flops'] / r['step'] / 1e9:>8.0f}")
    print(f"(CPU seconds of this process; x today: today's cost per block over this recipe's, with and without "
          f"the target's context forward)\nplain matmul [2048 x 576] @ [576 x 1536], {threads} thread(s): bf16 "
          f"{rates['bfloat16']:.0f} GFLOP/s, fp32 {rates['float32']:.0f} GFLOP/s")
    for k in sorted({k for _, k in res}):
        bar = 5 if k == 0 else 3
        full, bare = res["new", k]["ratios"]
        marks = ["meets" if x >= bar else "misses" for x in (full, bare)]
        print(f"new recipe, k = {k} (bar {bar}x): {full:.1f}x cheaper per block than today with the target's context "
              f"forward ({marks[0]}), {bare:.1f}x without it ({marks[1]})")
    if {("today", 0), ("today", 2), ("new", 0), ("new", 2)} <= res.keys():
        print("k = 2 / k = 0 step cost: " + ", ".join(f"{n} {res[n, 2]['step'] / res[n, 0]['step']:.2f}x"
                                                     for n in ("today", "new")))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--data", default=None, help="a `dflow data` folder (default: random sequences)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=1024, help="--max-len of the data; length of random sequences")
    p.add_argument("--today-anchors", type=int, default=32)
    p.add_argument("--new-anchors", type=int, default=512)
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--rounds", default="0,2", help="the k to measure")
    p.add_argument("--sweep", default="", help="anchor counts for the dense-vs-linear drafter sweep, e.g. 32,128,512")
    p.add_argument("--no-compile", action="store_true", help="the new recipe without compiled drafter layers")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    recipes = ladder(args)
    targets = {dtype: load_target(args.target, dtype) for dtype in {r.dtype for r in recipes}}
    seqs, source = sequences(args, *targets["bfloat16"])
    ks = [int(k) for k in args.rounds.split(",")]
    drafters = {k: Drafter(*targets["bfloat16"], k, args) for k in ks}
    runs = [Run(r, k, targets[r.dtype][0], drafters[k], seqs) for k in ks for r in recipes]
    print(f"{args.target}, {source}: {len(seqs)} sequences, {sum(len(s[0]) for s in seqs)} tokens; block "
          f"{args.block_size}, {args.layers} drafter layers; {threads} thread(s); {args.steps} timed steps after 1 "
          "warm-up, interleaved")
    for r in recipes:
        print(f"  {r.name}: target {r.dtype}, drafter autocast {'bf16' if r.bf16 else 'off'}, {r.anchors} anchors a "
              f"sequence, {'dense' if r.reference else 'linear'} layout{', compiled layers' if r.compile else ''}")
    for step in range(args.steps + 1):
        for run in runs:
            run.step(record=step > 0)
    report(runs, threads, {dtype: matmul_rate(getattr(torch, dtype)) for dtype in ("bfloat16", "float32")})
    if args.sweep:
        sweep(*targets["bfloat16"], seqs, args, [int(n) for n in args.sweep.split(",")], threads)


if __name__ == "__main__":
    main()
