"""Learning curves of `dflow train` runs from their metrics.jsonl, as one PNG.

    python scripts/plot_learning_curve.py RUN [RUN ...] --out results/train-ablations/curve.png [--smooth 50] [--chain]

Two rows of panels, against blocks trained and against core-hours (each step's `cpu_s`, its CPU
seconds summed over the run's processes; for runs that predate it, its wall time times --cores, a
step over 10x the run's median, a paused process, counting as the median): index-1 accuracy of round 0 (`acc1_r0`) and the
teacher-forced acceptance length 1 + `accepted_r0` (at most the block: where runs trained in different
blocks, by their folders' config.json, the legend gives each one's), each a running mean over --smooth steps. In a
run's first epoch every batch is unseen when it is scored, so these are held-out estimates (before
the step's update); held-out tau of the engine (`eval_tau` records) is drawn as points.

With --chain the runs are consecutive stages of one run (each later one started with `--init` from
the one before): blocks and core-hours add up across them. The held-out tau points are printed too,
each with the gain since the point nearest half its core-hours and since the one nearest half its
blocks (issue 14's stopping rule: the last doubling of compute adds < 0.05 held-out tau; blocks
read the same on a slower machine). A RUN may be a metrics .jsonl file (a committed copy).

--points FILE.json@HOURS ... adds readings of committed snapshots by scripts/eval_heldout.py (e.g.
over 256 tokens, less noisy than the run's own 64), each at the core-hours over all stages of its
snapshot (this script's printout): drawn as crosses, and printed with the gain since the reading
nearest half its core-hours among those of the same length and target dtype. With --chain each is
also placed by blocks trained (those of the logged step nearest its core-hours) and printed with
the gain since the like reading nearest half its blocks: the measure that holds when a stage ran
on a GPU, whose metrics count only its host CPU's seconds.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def running_mean(values: list[float], n: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - n] if i >= n else 0.0)
        out.append(total / min(i + 1, n))
    return out


def load(run: Path):
    """A run folder's metrics.jsonl, or a metrics file itself (a committed copy of a lost run's)."""
    path = run if run.suffix == ".jsonl" else run / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_tau" in r and not math.isnan(r["eval_tau"])]
    return steps, evals


def run_name(run: Path) -> str:
    """A run's label: its folder, a metrics file's stem, or the folder of a file named metrics.jsonl
    (a snapshot's: results/base-2j/metrics.jsonl is base-2j)."""
    if run.suffix != ".jsonl":
        return run.name
    return run.parent.name if run.name == "metrics.jsonl" else run.stem


def block_size(run: Path) -> int | None:
    """The block a run trained in, from the drafter config.json beside its metrics (a run or snapshot
    folder), or None (a bare metrics file, e.g. a committed copy, has no config of its own)."""
    folder = run if run.suffix != ".jsonl" else run.parent if run.name == "metrics.jsonl" else None
    config = folder / "config.json" if folder else None
    if config is None or not config.is_file():
        return None
    return json.loads(config.read_text()).get("block_size")


def series(runs: list[Path], chain: bool = False, cores: float = 1.0) -> list[dict]:
    """One dict per run: its steps' blocks and core-hours (cumulative, across runs with `chain`),
    index-1 accuracy and teacher-forced tau per step, and its held-out tau points (step, blocks,
    core-hours, tau); an eval at step 0 sits at the run's start. Where the runs' known blocks differ,
    each label says its block: teacher-forced tau is capped at the block, and so read against it."""
    out, b, h = [], 0, 0.0
    blocks_of = {run: block_size(run) for run in runs}
    mixed = len({v for v in blocks_of.values() if v is not None}) > 1
    for run in runs:
        steps, evals = load(run)
        if not chain:
            b, h = 0, 0.0
        start, blocks, hours = (b, h), [], []
        seconds = [r["tokens"] / r["tokens_per_s"] for r in steps]
        median = sorted(seconds)[len(seconds) // 2] if seconds else 0.0
        for r, sec in zip(steps, seconds):
            b += r["anchors_r0"]
            h += r["cpu_s"] / 3600 if "cpu_s" in r else (sec if sec <= 10 * median else median) * cores / 3600
            blocks.append(b)
            hours.append(h)

        def at(step: int) -> tuple[int, float]:
            i = min(step, len(steps)) - 1
            return start if i < 0 else (blocks[i], hours[i])

        points = [(e["step"], *at(e["step"]), e["eval_tau"]) for e in evals]
        name = f"{run_name(run)} (blocks of {blocks_of[run]})" if mixed and blocks_of[run] else run_name(run)
        out.append({"name": name, "blocks": blocks, "hours": hours, "points": points, "start_hours": start[1],
                    "acc1": [r["acc1_r0"] for r in steps], "tau_tf": [1 + r["accepted_r0"] for r in steps]})
    return out


def nearest_half(earlier: list, x: float, at):
    """The earlier point whose compute `at(point)` is nearest x / 2 (the first such), or None."""
    return min(earlier, key=lambda p: abs(at(p) - x / 2)) if earlier else None


def doubling_gains(curves: list[dict], chain: bool = False, axis: str = "hours") -> list[tuple[str, int, float, float, float | None, float | None]]:
    """(run, step, compute, tau, compute of the point nearest half as much, tau gained since) for every
    held-out tau point, compute in core-hours or (`axis="blocks"`) blocks trained; the earlier point is
    from the same run, or from any run with `chain`. Blocks do not depend on the machine's speed."""
    k = {"blocks": 1, "hours": 2}[axis]
    rows = []
    for c in curves:
        pool = [p for cc in curves for p in cc["points"]] if chain else c["points"]
        for point in c["points"]:
            x = point[k]
            earlier = [p for p in pool if p[k] < x]
            half = nearest_half(earlier, x, lambda p: p[k])
            rows.append((c["name"], point[0], x, point[3], half[k] if half else None,
                         point[3] - half[3] if half else None))
    return rows


def snapshot_points(specs: list[str]) -> list[dict]:
    """FILE.json@HOURS -> eval_heldout's record with "core_hours" = HOURS, "file" and "eval_dtype"."""
    points = []
    for spec in specs:
        file, sep, hours = spec.rpartition("@")
        if not sep or not file:
            raise SystemExit(f"error: --points {spec!r}: expected FILE.json@HOURS")
        try:
            rec = json.loads(Path(file).read_text())
            # a record from before eval_dtype was kept was read with eval_heldout's --dtype default, bfloat16 since its first commit
            points.append({"eval_dtype": "bfloat16", **rec, "file": file, "core_hours": float(hours)})
        except (OSError, ValueError) as e:
            raise SystemExit(f"error: --points {spec!r}: {e}") from None
    return sorted(points, key=lambda r: r["core_hours"])


def kind(point: dict) -> tuple:
    """What a reading is comparable by: tokens decoded, target dtype (it moves tau) and draft block (a
    reading without one predates blocks other than the drafter's own: 16)."""
    return point.get("tokens"), point["eval_dtype"], point.get("block_size", 16)


def blocks_at(curves: list[dict], hours: float) -> int | None:
    """Blocks trained by the logged step of the chained curves nearest `hours` core-hours (the later
    of two as near), so a snapshot placed by its core-hours is placed by blocks too. A GPU stage adds
    little host time a step: give its snapshots' hours to enough decimals."""
    pairs = [(h, b) for c in curves for h, b in zip(c["hours"], c["blocks"])]
    if not pairs:
        return None
    return min(reversed(pairs), key=lambda p: abs(p[0] - hours))[1]


def snapshot_gains(points: list[dict], key: str = "core_hours") -> list[tuple[dict, float | None, float | None]]:
    """(reading, compute of the like reading nearest half its own, tau gained since), compute by `key`
    (core_hours, or blocks when the points have them): like readings are those of the same `kind`."""
    rows = []
    for p in points:
        if p.get(key) is None:
            rows.append((p, None, None))
            continue
        like = [q for q in points if q.get(key) is not None and q[key] < p[key] and kind(q) == kind(p)]
        half = nearest_half(like, p[key], lambda q: q[key])
        rows.append((p, half[key] if half else None, p["eval_tau"] - half["eval_tau"] if half else None))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+")
    p.add_argument("--out", required=True)
    p.add_argument("--smooth", type=int, default=50)
    p.add_argument("--chain", action="store_true", help="the runs are consecutive stages: blocks and core-hours add up")
    p.add_argument("--cores", type=float, default=1.0, help="cores each run used, for runs without cpu_s (core-hours = wall x cores)")
    p.add_argument("--points", nargs="+", default=[], metavar="FILE.json@HOURS",
                   help="scripts/eval_heldout.py readings of snapshots, at their core-hours over all stages")
    args = p.parse_args()
    curves = series([Path(r) for r in args.runs], args.chain, args.cores)
    snaps = snapshot_points(args.points)
    if args.chain:
        for r in snaps:
            r["blocks"] = blocks_at(curves, r["core_hours"])
    fig = Figure(figsize=(11, 7.5))
    axes = fig.subplots(2, 2)
    palette = colormaps["tab20"] if len(curves) > 10 else None  # the default cycle repeats after 10 runs
    for i, c in enumerate(curves):
        acc1, tau_tf = running_mean(c["acc1"], args.smooth), running_mean(c["tau_tf"], args.smooth)
        color = palette(i % 20) if palette else None
        for col, x in enumerate((c["blocks"], c["hours"])):
            axes[0][col].plot(x, acc1, label=c["name"], color=color)
            lines = axes[1][col].plot(x, tau_tf, label=c["name"], color=color)
            axes[1][col].scatter([q[1 + col] for q in c["points"]], [q[3] for q in c["points"]], marker="o", s=30,
                                 color=lines[0].get_color())
    for col, key in ((1, "core_hours"), (0, "blocks")):
        blocks = {kind(r)[2] for r in snaps}  # blocks named once readings in several are drawn
        crosses = [axes[1][col].scatter([r[key] for r in mine], [r["eval_tau"] for r in mine],
                                        marker="x" if block == max(blocks) else "+", s=40,
                                        label=f"snapshots: engine tau over {tokens} tokens"
                                              + (f", blocks of {block}" if len(blocks) > 1 else ""))
                   for tokens, block in sorted({(r.get("tokens"), kind(r)[2]) for r in snaps}, key=str)
                   for mine in [[r for r in snaps if (r.get("tokens"), kind(r)[2]) == (tokens, block)
                                 and r.get(key) is not None]] if mine]
        if crosses:
            axes[1][col].legend(handles=crosses, fontsize=8, loc="upper left")
    for col, xlabel in enumerate(("blocks trained", "core-hours")):
        axes[0][col].set_ylabel(f"index-1 accuracy (mean of {args.smooth} steps)")
        axes[1][col].set_ylabel("1 + accepted (teacher-forced); dots: engine tau")
        for row in (0, 1):
            axes[row][col].set_xlabel(xlabel)
            axes[row][col].grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    by_blocks = doubling_gains(curves, args.chain, axis="blocks")
    for (name, step, hrs, tau, half, gain), (_, _, blocks, _, half_b, gain_b) in zip(doubling_gains(curves, args.chain), by_blocks):
        since = f"  {gain:+.3f} since {half:.2f} core-h" if gain is not None else ""
        since_b = f"; {gain_b:+.3f} since {half_b:,} blocks" if gain_b is not None else ""
        print(f"{name} step {step}: {hrs:.2f} core-h, {blocks:,} blocks, held-out tau {tau:.3f}{since}{since_b}")
    for (r, half, gain), (_, half_b, gain_b) in zip(snapshot_gains(snaps), snapshot_gains(snaps, "blocks")):
        since = f"  {gain:+.3f} since {half:.2f} core-h" if gain is not None else ""
        since_b = f"; {gain_b:+.3f} since {half_b:,} blocks" if gain_b is not None else ""
        blocks = f", {r['blocks']:,} blocks" if r.get("blocks") is not None else ""
        print(f"{r['file']} ({r.get('tokens')} tokens): {r['core_hours']:.2f} core-h{blocks}, "
              f"held-out tau {r['eval_tau']:.3f}{since}{since_b}")
    for c in (c for c in curves if c["hours"]):  # where each run's log ends, and its mean step cost
        steps = len(c["hours"])
        print(f"{c['name']} last logged step {steps}: {c['hours'][-1]:.2f} core-h, "
              f"{(c['hours'][-1] - c['start_hours']) * 3600 / steps:.2f} core-s a step")
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig).print_png(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
