"""The ablation table of issue 18 from the runs of scripts/ablate.sh (default folder runs/abl).

    python scripts/ablation_table.py [--runs runs/abl] [--json results/train-ablations/ablations.json]

With --json the table is that file's rows (kept when their run folders are gone, e.g. on a new
machine) updated by the runs found, and written back.

One row per run: its flags (from the run's checkpoint config), optimizer steps, blocks trained,
core-minutes (user + system CPU time of the training process, from /usr/bin/time in NAME.log: the
compile, the steps and the final held-out tau, if any), the
last 10 steps' training loss and index-1 accuracy, the held-out teacher-forced accuracy at block
indices 1..4 (NAME.probe.json) and, where the run measured it, held-out tau.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path


def cpu_seconds(log: str) -> float | None:
    user = re.search(r"User time \(seconds\): ([\d.]+)", log)
    system = re.search(r"System time \(seconds\): ([\d.]+)", log)
    return float(user.group(1)) + float(system.group(1)) if user and system else None


def run_row(folder: Path) -> dict | None:
    log_path, probe_path = folder.parent / f"{folder.name}.log", folder.parent / f"{folder.name}.probe.json"
    metrics = folder / "metrics.jsonl"
    if not (log_path.exists() and metrics.exists()):
        return None
    log = log_path.read_text()
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_tau" in r and not math.isnan(r["eval_tau"])]
    last = steps[-10:]
    row = {"name": folder.name, "steps": len(steps), "blocks": sum(r["anchors_r0"] for r in steps),
           "core_min": (cpu_seconds(log) or float("nan")) / 60,
           "train_loss": sum(r["loss"] for r in last) / max(1, len(last)),
           "train_acc1": sum(r["acc1_r0"] for r in last) / max(1, len(last)),
           "tau": evals[-1]["eval_tau"] if evals else None, "flags": flags_of(log)}
    if probe_path.exists():
        row["held_out_acc"] = json.loads(probe_path.read_text())["drafter_index_acc"]
    return row


# scripts/ablate.sh's series baseline, which it puts before a row's own flags (SHAPE only for a fresh drafter)
SHAPE = "--layers 5 --target-layers 5 --draft-vocab full"
BASELINE = "--loss-gamma dflash --block-bias 0 --lr 6e-4 --batch-size 4 --anchors-per-seq 32 --loss ce"


def flags_of(log: str) -> str:
    """The row's own flags: the timed command's `dflow train` flags less what every row shares
    (ablate.sh's fixed settings and its baseline)."""
    m = re.search(r"Command being timed: \"(.*)\"", log)
    if not m:
        return ""
    words = m.group(1).split()
    keep, with_value = [], {"--data", "--out", "--eval-samples", "--eval-tokens", "--save-every", "--max-len",
                            "--rounds", "--dtype"}
    i = words.index("train") + 1 if "train" in words else 0
    while i < len(words):
        w = words[i]
        if w in with_value:
            i += 2
            continue
        if w not in ("--no-progress", "--bf16", "--compile"):
            keep.append(w)
        i += 1
    flags = " ".join(keep)
    for prefix in (f"{SHAPE} {BASELINE}", BASELINE):
        if flags.startswith(prefix):
            return flags[len(prefix):].strip()
    return flags


def merge(old: list[dict], new: list[dict]) -> list[dict]:
    """The table's rows `old` updated by the rows read from the runs folder: a run in both takes its
    new row in its old place; new runs follow in order."""
    fresh = {r["name"]: r for r in new}
    names = {r["name"] for r in old}
    return [fresh.get(r["name"], r) for r in old] + [r for r in new if r["name"] not in names]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", default="runs/abl")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows = [r for r in (run_row(f) for f in sorted(Path(args.runs).iterdir()) if f.is_dir()) if r]
    if args.json and Path(args.json).exists():  # the runs already in the table stay, though their folders be gone
        rows = merge(json.loads(Path(args.json).read_text()), rows)
    print("| run | flags | steps | blocks | core-min | train loss (last 10) | train acc@1 (last 10) "
          "| held-out acc@1..4 | held-out tau |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        acc = " / ".join(f"{a:.3f}" for a in r.get("held_out_acc", [])) or "-"
        tau = f"{r['tau']:.3f}" if r["tau"] is not None else "-"
        print(f"| {r['name']} | `{r['flags']}` | {r['steps']} | {r['blocks']:,} | {r['core_min']:.1f} | "
              f"{r['train_loss']:.2f} | {r['train_acc1']:.3f} | {acc} | {tau} |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
