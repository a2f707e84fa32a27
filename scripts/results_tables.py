"""The paper's Table 1 and Table 3 at CPU scale, from `dflow bench` outputs, printed as Markdown.

    python scripts/results_tables.py --t0 results/bench-t0 [--t1 results/bench-t1] \
        [--train dflash=runs/a dflash-sc=runs/b dflow=runs/c] [--fp32 results/audit-fp32] [--into docs/results.md]

Reads each folder's results.json (labels as `dflow bench --variant` wrote them: ar, pld, dflash,
dflash-sc, dflow, dflow-relay-off) and prints: tau per dataset and overall at each temperature
(Table 1), mask vs relay (Table 3) beside the paper's figures, speedups over ar and pld, the
per-round runtime split, each issue bar with its measured value, the lossless audit and, with
--train, each run's training cost. Labels a run lacks are left out.
"""

from __future__ import annotations

import argparse
import json
import shlex
import math
from pathlib import Path

from dflow import metrics

ORDER = ("ar", "pld", "dflash", "dflash-sc", "dflow-relay-off", "dflow")
NAMES = {"ar": "AR (target alone)", "pld": "PLD (prompt lookup)", "dflash": "DFlash (run a)",
         "dflash-sc": "DFlash + self-conditioning (run b)", "dflow-relay-off": "DFlow, relay off (run c)",
         "dflow": "DFlow (run c)"}
BEGIN, END = "<!-- results_tables: begin -->", "<!-- results_tables: end -->"
# Paper, Qwen3-1.7B, T = 0, average tau (Tables 1 and 3).
PAPER_T0 = {"dflash": 3.56, "dflash-sc": 3.67, "dflow-relay-off": 3.66, "dflow": 3.93}


def f(x, spec=".2f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def load(folder: str) -> dict:
    return json.loads((Path(folder) / "results.json").read_text())


def datasets(res: dict) -> list[str]:
    return [d for d in res if d != "overall"]


def labels(res: dict) -> list[str]:
    have = res["overall"]
    return [m for m in ORDER if m in have] + [m for m in have if m not in ORDER]


def table(rows: list[list[str]], head: list[str]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def tau_table(res: dict) -> str:
    ds = datasets(res)
    rows = [[NAMES.get(m, m)] + [f(res[d].get(m, {}).get("tau")) for d in ds] + [f(res["overall"][m]["tau"])]
            for m in labels(res)]
    return table(rows, ["method"] + ds + ["overall"])


def tok_ratio(res: dict, d: str, m: str, base: str) -> float | None:
    """Decode tokens/s of label m over label base's on dataset d (issue 14's speed measure: in bf16
    the labels' outputs, so their lengths, differ; `speedup`, the decode-time ratio, ignores that)."""
    a, b = res[d].get(m), res[d].get(base)
    return a["tokens_per_s"] / b["tokens_per_s"] if a and b and b.get("tokens_per_s") else None


def speed_table(res: dict) -> str:
    ds = datasets(res) + ["overall"]
    rows = []
    for m in labels(res):
        cells = []
        for d in ds:
            c = res[d].get(m)
            if c is None:
                cells.append("n/a")
                continue
            cells.append(f"{f(tok_ratio(res, d, m, 'ar'))}x ({f(tok_ratio(res, d, m, 'pld'))}x pld; "
                         f"{f(c['tokens_per_s'], '.1f')} tok/s; time {f(c['speedup'])}x)")
        rows.append([NAMES.get(m, m)] + cells)
    return table(rows, ["method"] + [f"{d}: tok/s vs ar (vs pld; tok/s; decode-time speedup)" for d in ds])


def ablation_table(res: dict) -> str:
    ds = datasets(res)
    rows = []
    for m in ("dflash", "dflash-sc", "dflow-relay-off", "dflow"):
        if m in res["overall"]:
            rows.append([NAMES[m]] + [f(res[d].get(m, {}).get("tau")) for d in ds]
                        + [f(res["overall"][m]["tau"]), f(PAPER_T0[m])])
    return table(rows, ["method"] + ds + ["overall", "paper (Qwen3-1.7B, avg)"])


def breakdown_table(res: dict) -> str:
    rows = []
    for m in labels(res):
        split = res["overall"][m].get("time_split_ms")
        if m == "ar" or not split:
            continue
        total = split["total"] or math.nan
        rows.append([NAMES.get(m, m)] + [f"{f(split[k])} ({f(100 * split[k] / total, '.1f')}%)"
                                         for k in ("draft", "relay", "verify", "bookkeeping")] + [f(total)])
    return table(rows, ["method", "draft ms", "relay ms", "verify ms", "bookkeeping ms", "round ms"])


def audit_table(res: dict) -> str:
    ds = datasets(res)
    rows = []
    for m in labels(res):
        if m == "ar":
            continue
        cells = []
        for d in ds:
            c = res[d].get(m)
            mism = None if c is None else c.get("mismatches")
            gens = None if c is None else c.get("num_generations", c.get("num_prompts"))
            cells.append("n/a" if mism is None else f"{gens - mism}/{gens} identical")
        rows.append([NAMES.get(m, m)] + cells)
    return table(rows, ["method"] + ds)


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def bars(res: dict) -> list[str]:
    """Issue 14's bars (the shipped drafter, T = 0), each with its measured value."""
    o, ds, out = res["overall"], datasets(res), []
    if "dflow" in o:
        t = o["dflow"]["tau"]
        out.append(f"- overall tau >= 2.2 (dflow): **{t:.3f}** ({verdict(t >= 2.2)})")
        per = {d: tok_ratio(res, d, "dflow", "ar") for d in ds}
        if all(v is not None for v in per.values()):
            out.append("- dflow tokens/s >= 1.4x ar on every dataset: " + ", ".join(
                f"{d} {v:.2f}x" for d, v in per.items()) + f" ({verdict(all(v >= 1.4 for v in per.values()))})")
        he = tok_ratio(res, "humaneval", "dflow", "pld") if "humaneval" in res else None
        if he is not None:
            out.append(f"- dflow tokens/s >= pld on HumanEval: **{he:.2f}x** pld ({verdict(he >= 1)})")
    if "dflow" in o and "dflash" in o:
        r = o["dflow"]["tau"] / o["dflash"]["tau"]
        out.append(f"- DFlow tau / DFlash tau >= 1.05, overall: **{r:.3f}** ({verdict(r >= 1.05)})")
    if "dflow" in o and "dflow-relay-off" in o:
        per = {d: (res[d]["dflow"]["tau"], res[d]["dflow-relay-off"]["tau"]) for d in ds}
        out.append("- relay on > off on every dataset (paired s.e. above): " + ", ".join(
            f"{d} {on:.3f} vs {off:.3f}" for d, (on, off) in per.items())
            + f" ({verdict(all(on > off for on, off in per.values()))})")
    return out


def train_cost(runs: list[str]) -> str:
    rows = []
    for spec in runs:
        label, _, folder = spec.partition("=")
        recs = [json.loads(line) for line in (Path(folder) / "metrics.jsonl").read_text().splitlines()]
        # A resumed run logs again the steps after its last checkpoint: keep each step's last record.
        steps = list({r["step"]: r for r in recs if "loss" in r}.values())
        evals = [r for r in recs if "eval_tau" in r]
        seconds = sum(r["tokens"] / r["tokens_per_s"] for r in steps if r["tokens_per_s"] > 0)
        tail = steps[-10:]  # one step is noisy: the mean of the last 10
        last = {k: sum(r[k] for r in tail) / len(tail) for k in tail[0] if k.startswith("acc_r")} if tail else {}
        rounds = sorted(last)
        core_h = sum(r.get("cpu_s", 0.0) for r in steps) / 3600
        blocks = sum(r.get("anchors_r0", 0) for r in steps)
        rows.append([label, folder, str(len(steps)), f"{seconds / 60:.1f}", f"{core_h:.2f}", f"{blocks:,}",
                     ", ".join(f"{k[4:]} {last[k]:.3f}" for k in rounds),
                     f(evals[-1]["eval_tau"], ".3f") if evals else "n/a"])
    return table(rows, ["run", "folder", "steps", "step time, min", "core-hours", "round-0 blocks", "draft accuracy per round (last 10 steps)",
                        "held-out tau (end)"])


def prompts_per_dataset(res: dict) -> dict[str, int]:
    return {d: res[d][next(iter(res[d]))]["num_prompts"] for d in datasets(res)}


def journal_records(folder: str, saved: dict) -> list[dict] | None:
    """The bench journal's records of the prompts the run reports: those below its --num-prompts
    (a --shard or --report-only run may hold any of them; None without a journal)."""
    path = Path(folder) / "progress.jsonl"
    if not path.exists():
        return None
    words = shlex.split(saved["meta"]["command"])
    n = int(words[words.index("--num-prompts") + 1])
    reported = set(datasets(saved["results"]))
    records = (json.loads(line) for line in path.read_text().splitlines()[1:])
    return [rec for rec in records if rec["index"] < n and rec["dataset"] in reported]


def journal_minutes(records: list[dict]) -> float:
    """Generation time of the reported prompts, summed from the bench journal (a resumed or merged
    run's own wall time covers only what it generated itself)."""
    return sum(g["call_s"] for rec in records for gens in rec["turns"].values() for g in gens) / 60


PAIRS = (("dflow", "dflow-relay-off"), ("dflow", "dflash"), ("dflash-sc", "dflash"), ("dflow-relay-off", "dflash-sc"),
         ("base-768", "base-218"))  # the last: the data-size check (scripts/reproduce.sh more_data)


def paired_table(records: list[dict] | None, res: dict) -> str | None:
    """Per-prompt tau differences between two labels on the same prompts: mean +- standard error, and
    how many prompts each side wins, so a gap can be told from noise."""
    if records is None:
        return None
    per = {}  # (dataset, label) -> [tau of each prompt]
    for rec in records:
        for label, gens in rec["turns"].items():
            rounds = [r for g in gens for r in g["rounds"]]
            per.setdefault((rec["dataset"], label), []).append(
                sum(r["committed"] for r in rounds) / max(len(rounds), 1))
    rows = []
    for a, b in PAIRS:
        for d in datasets(res):
            if (d, a) not in per or (d, b) not in per:
                continue
            p = metrics.paired(per[d, a], per[d, b])
            rows.append([f"{a} - {b}", d, str(p.n), f"{p.mean:+.3f} +- {f(p.se, '.3f')}", f"{p.wins} / {p.losses}"])
    if not rows:
        return None
    return table(rows, ["difference", "dataset", "prompts", "mean tau difference +- s.e.", "prompts won / lost"])


def meta_line(saved: dict, records: list[dict] | None) -> str:
    m = saved["meta"]
    spent = (f"generation {journal_minutes(records):.1f} min in all (summed over the journal)" if records is not None
             else f"bench wall {m['bench_wall_s'] / 60:.1f} min")
    threads, hardware = m["machine"]["torch_threads"], m["machine"].get("hardware")
    return (f"`{m['command']}` — {m.get('dtype')}, {threads} thread{'s' * (threads != 1)} per process"
            f"{f' on {hardware}' if hardware else ''}, {spent}")


def section(title: str, body: str, lead: str | None = None) -> str:
    """One Markdown section: heading, optional lead line, the table."""
    return "\n\n".join([f"## {title}"] + ([lead] if lead else []) + [body])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--t0", required=True, help="dflow bench folder at T = 0")
    p.add_argument("--t1", default=None, help="dflow bench folder at T = 1")
    p.add_argument("--fp32", default=None, help="dflow bench folder of the float32 audit")
    p.add_argument("--train", nargs="*", default=[], metavar="LABEL=RUN_DIR")
    p.add_argument("--into", default=None, metavar="MARKDOWN",
                   help=f"replace the block between {BEGIN} and {END} in this file (headings one level "
                        "down) instead of printing")
    args = p.parse_args()

    t0 = load(args.t0)
    res = t0["results"]
    rec0 = journal_records(args.t0, t0)  # read once: meta line and paired table
    n = prompts_per_dataset(res)
    out = []
    t1 = load(args.t1) if args.t1 else None
    fp = load(args.fp32) if args.fp32 else None
    out.append(section("Table 1 analog: tau (committed tokens per round), T = 0", tau_table(res),
                       f"Prompts per dataset: {n}. Command: {meta_line(t0, rec0)}"))
    rec1 = journal_records(args.t1, t1) if t1 else None
    if t1:
        out.append(section("Table 1 analog: tau, T = 1", tau_table(t1["results"]),
                           f"Prompts per dataset: {prompts_per_dataset(t1['results'])}. "
                           f"Command: {meta_line(t1, rec1)}"))
    out.append(section("Table 3 analog: mask vs relay, T = 0", ablation_table(res)))
    out.append(section("Speedup over ar (and over pld), T = 0, bf16", speed_table(res)))
    if t1:
        out.append(section("Speedup over ar, T = 1", speed_table(t1["results"])))
    paired = paired_table(rec0, res)
    if paired:
        out.append(section("Paired differences per prompt, T = 0", paired,
                           "Tau of each prompt (all its turns), one label minus another on the same prompts."))
    paired_t1 = paired_table(rec1, t1["results"]) if t1 else None
    if paired_t1:
        out.append(section("Paired differences per prompt, T = 1", paired_t1,
                           "As at T = 0; each label samples its own text, so these also carry sampling noise."))
    out.append(section("Runtime per round (ms), T = 0", breakdown_table(res)))
    out.append(section("Bars (T = 0)", "\n".join(bars(res))))
    out.append(section("Agreement with ar (bf16, T = 0)", audit_table(res)))
    if fp:
        out.append(section("Lossless audit, float32", audit_table(fp["results"]), f"Command: {meta_line(fp, journal_records(args.fp32, fp))}"))
    if args.train:
        out.append(section("Training cost", train_cost(args.train)))

    text = "\n\n".join(out)
    if args.into:
        write_into(Path(args.into), text)
    else:
        print(text)


def write_into(path: Path, text: str) -> None:
    """Put `text` (its `## ` headings made `### `) between the markers of `path`."""
    doc = path.read_text()
    if BEGIN not in doc or END not in doc:
        raise SystemExit(f"{path} lacks the markers {BEGIN} and {END}")
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    body = "\n".join("#" + line if line.startswith("## ") else line for line in text.splitlines())
    path.write_text(f"{head}{BEGIN}\n\n{body}\n\n{END}{tail}")

if __name__ == "__main__":
    main()
