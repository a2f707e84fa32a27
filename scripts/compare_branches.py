"""Issue 14, step 2: is DFlow's acceptance in rounds 1..k measurably above self-conditioning's
during training? Paired by step, from the two branches' metrics.jsonl:

    python scripts/compare_branches.py runs/c runs/b [--window 100] [--sigmas 3] [--plot FILE] [--json FILE]

The branches start from the same drafter with the same seed, so step s of each trains on the same
sequences and round-0 anchors; a step's teacher-forced accepted length per round (`accepted_rq`,
the mean over the step's blocks) differs between them by the objective and by the batch noise
they share, which the pairing cancels. Per round, and for rounds 1..k summed, it prints each
run's mean over the last --window common steps and the paired difference A - B with its standard
error (`dflow.metrics.paired`); "measurable" is a difference above --sigmas standard errors. The
plot draws the difference of rounds 1..k against the step, a running mean over --window steps
with its +-sigmas band. A RUN may be a metrics .jsonl file (a committed copy). Two DFlash runs
(k = 0, e.g. branch (a) at two learning rates) compare on round 0 alone.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from dflow import metrics


def steps_of(run: str) -> dict[int, dict]:
    path = Path(run) if run.endswith(".jsonl") else Path(run) / "metrics.jsonl"
    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r}


def rounds_of(records: dict[int, dict]) -> int:
    """k: the highest round a run logs."""
    first = next(iter(records.values()))
    return max(int(key[len("accepted_r"):]) for key in first if key.startswith("accepted_r"))


def later_rounds(rec: dict, k: int) -> float:
    """Accepted length summed over rounds 1..k of one step; round 0's when k = 0 (two DFlash runs,
    e.g. two learning rates of branch (a))."""
    return sum(rec[f"accepted_r{q}"] for q in range(1, k + 1)) if k else rec["accepted_r0"]


def compare(a: dict[int, dict], b: dict[int, dict], window: int, sigmas: float) -> dict:
    common = sorted(a.keys() & b.keys())
    k = min(rounds_of(a), rounds_of(b))
    if not common:
        raise SystemExit("the runs share no step")
    last = common[-window:]
    series = {f"r{q}": (lambda r, q=q: r[f"accepted_r{q}"]) for q in range(k + 1)}
    if k:
        series[f"r1..{k}"] = lambda r: later_rounds(r, k)
    out = {"steps": [common[0], common[-1]], "window": [last[0], last[-1]], "sigmas": sigmas, "rounds": {}}
    for name, get in series.items():
        xa, xb = [get(a[s]) for s in last], [get(b[s]) for s in last]
        p = metrics.paired(xa, xb)
        out["rounds"][name] = {"a": sum(xa) / len(xa), "b": sum(xb) / len(xb), "diff": p.mean, "se": p.se,
                               "wins": p.wins, "losses": p.losses, "measurable": p.mean > sigmas * p.se}
    return out


def plot(a: dict[int, dict], b: dict[int, dict], window: int, sigmas: float, labels: tuple[str, str], path: str):
    common = sorted(a.keys() & b.keys())
    k = min(rounds_of(a), rounds_of(b))
    diff = [later_rounds(a[s], k) - later_rounds(b[s], k) for s in common]
    mean, lo, hi = [], [], []
    for i in range(len(diff)):
        chunk = diff[max(0, i + 1 - window): i + 1]
        p = metrics.paired(chunk, [0.0] * len(chunk))
        se = p.se if len(chunk) > 1 else 0.0
        mean.append(p.mean), lo.append(p.mean - sigmas * se), hi.append(p.mean + sigmas * se)
    fig = Figure(figsize=(7, 3.6))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(common, diff, ".", ms=2, alpha=0.3, color="grey", label="one step")
    ax.plot(common, mean, color="C0", label=f"running mean, {window} steps")
    ax.fill_between(common, lo, hi, color="C0", alpha=0.2, label=f"+-{sigmas:g} s.e.")
    ax.axhline(0, color="black", lw=0.8)
    ax.set_ylim(min(lo + [0]) - 0.1, max(hi + [0]) + 0.1)
    ax.set(xlabel="step", ylabel=f"accepted, {f'rounds 1..{k}' if k else 'round 0'}: {labels[0]} - {labels[1]}",
           title="Relay vs self-conditioning only, paired by training batch")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a", help="DFlow branch (c): run folder or metrics .jsonl")
    p.add_argument("b", help="self-conditioning branch (b)")
    p.add_argument("--window", type=int, default=100, help="the last N common steps")
    p.add_argument("--sigmas", type=float, default=3.0)
    p.add_argument("--plot", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    a, b = steps_of(args.a), steps_of(args.b)
    res = compare(a, b, args.window, args.sigmas)
    w = res["window"]
    print(f"steps {w[0]}..{w[1]} of {res['steps'][1]} (paired): accepted length per block, teacher-forced")
    print(f"| round | {args.a} | {args.b} | difference +- s.e. | steps won / lost | above {args.sigmas:g} s.e. |")
    print("|---|---|---|---|---|---|")
    for name, r in res["rounds"].items():
        print(f"| {name} | {r['a']:.3f} | {r['b']:.3f} | {r['diff']:+.3f} +- {r['se']:.3f} | {r['wins']} / "
              f"{r['losses']} | {'yes' if r['measurable'] else 'no'} |")
    if args.plot:
        plot(a, b, args.window, args.sigmas, (args.a, args.b), args.plot)
    if args.json:
        Path(args.json).write_text(json.dumps({"a": args.a, "b": args.b, **res}, indent=1) + "\n")


if __name__ == "__main__":
    main()
