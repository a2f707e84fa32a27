"""Learning curves of `dflow train` runs from their metrics.jsonl, as one PNG.

    python scripts/plot_learning_curve.py RUN [RUN ...] --out results/train-ablations/curve.png [--smooth 50]

Two rows of panels, against blocks trained and against core-hours (each step's `cpu_s`, its CPU
seconds summed over the run's processes; for runs that predate it, its wall time times --cores, a
step over 10x the run's median, a paused process, counting as the median): index-1 accuracy of round 0 (`acc1_r0`) and the
teacher-forced acceptance length 1 + `accepted_r0`, each a running mean over --smooth steps. In a
run's first epoch every batch is unseen when it is scored, so these are held-out estimates (before
the step's update); held-out tau of the engine (`eval_tau` records) is drawn as points.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def running_mean(values: list[float], n: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - n] if i >= n else 0.0)
        out.append(total / min(i + 1, n))
    return out


def load(run: Path):
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_tau" in r and not math.isnan(r["eval_tau"])]
    return steps, evals


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+")
    p.add_argument("--out", required=True)
    p.add_argument("--smooth", type=int, default=50)
    p.add_argument("--cores", type=float, default=1.0, help="cores each run used, for runs without cpu_s (core-hours = wall x cores)")
    args = p.parse_args()
    fig = Figure(figsize=(11, 7.5))
    axes = fig.subplots(2, 2)
    for run in map(Path, args.runs):
        steps, evals = load(run)
        blocks, hours, b, h = [], [], 0, 0.0
        seconds = [r["tokens"] / r["tokens_per_s"] for r in steps]
        median = sorted(seconds)[len(seconds) // 2]
        for r, sec in zip(steps, seconds):
            b += r["anchors_r0"]
            h += r["cpu_s"] / 3600 if "cpu_s" in r else (sec if sec <= 10 * median else median) * args.cores / 3600
            blocks.append(b)
            hours.append(h)
        acc1 = running_mean([r["acc1_r0"] for r in steps], args.smooth)
        tau_tf = running_mean([1 + r["accepted_r0"] for r in steps], args.smooth)
        for col, x in enumerate((blocks, hours)):
            axes[0][col].plot(x, acc1, label=run.name)
            axes[1][col].plot(x, tau_tf, label=run.name)
            for e in evals:
                i = min(max(e["step"] - 1, 0), len(x) - 1)
                axes[1][col].scatter([x[i]], [e["eval_tau"]], marker="o", s=30)
    for col, xlabel in enumerate(("blocks trained", "core-hours")):
        axes[0][col].set_ylabel(f"index-1 accuracy (mean of {args.smooth} steps)")
        axes[1][col].set_ylabel("1 + accepted (teacher-forced); dots: engine tau")
        for row in (0, 1):
            axes[row][col].set_xlabel(xlabel)
            axes[row][col].grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig).print_png(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
