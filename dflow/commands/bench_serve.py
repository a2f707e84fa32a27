"""`dflow bench-serve`: the paper's serving benchmark (Table 2) on vLLM: output tokens/s of plain,
DFlash and DFlow servers at each concurrency, speedup over plain, and vLLM's own acceptance
counters -> results.json, report.md, throughput.png.

Each method gets its own server (started, measured at every concurrency, stopped: one at a time,
so they never compete for cores). DFlash drafts with --drafter's drafter, relay off, or with its own
trained drafter (--dflash-drafter: the paper's DFlash baseline). Every concurrency level sends the same prompts (the first
--num-prompts of each dataset, first turn, chat template), greedy; outputs are audited against
plain vLLM's at the same concurrency.
"""

from __future__ import annotations

import argparse
import math
import shlex
import subprocess
import sys
import time
from pathlib import Path

from dflow.commands.bench import _load_datasets, _names
from dflow.commands.serve import HOST, add_server_args, server_command
from dflow.datasets import DATASETS
from dflow.errors import DFlowError
from dflow.proposers import METHODS
from dflow.vllm import bench
from dflow.vllm.report import write_serving_report

DEFAULT_DATASETS = "humaneval,gsm8k"


def add_parser(sub) -> None:
    b = sub.add_parser("bench-serve", help="serving benchmark on vLLM: tokens/s and speedup per concurrency (Table 2)")
    b.add_argument("--concurrency", default="1,2,4,8", help="comma-separated concurrency levels")
    b.add_argument("--datasets", default=None, help=f"comma-separated, from {', '.join(DATASETS)} (default "
                                                    f"{DEFAULT_DATASETS}, less those not installed here)")
    b.add_argument("--num-prompts", type=int, default=10, help="first N prompts of each dataset")
    b.add_argument("--methods", default="ar,dflash,dflow", help="comma-separated, from ar, dflash, dflow")
    b.add_argument("--max-new-tokens", type=int, default=256)
    b.add_argument("--dflash-drafter", default=None, metavar="DIR",
                   help="the dflash server's drafter (default: --drafter's, with relay off)")
    b.add_argument("--port", type=int, default=8011)
    b.add_argument("--out", required=True, help="output folder")
    add_server_args(b)
    b.set_defaults(func=run)


def _levels(text: str) -> list[int]:
    try:
        levels = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise DFlowError(f"--concurrency takes integers like 1,2,4,8, got {text!r}") from None
    if not levels or levels[0] < 1:
        raise DFlowError(f"--concurrency levels must be >= 1, got {text!r}")
    return levels


def method_args(args, method: str):
    """The server settings of one method: --dflash-drafter replaces --drafter for dflash."""
    if method == "dflash" and args.dflash_drafter is not None:
        return argparse.Namespace(**{**vars(args), "drafter": args.dflash_drafter})
    return args


def _serve(args, method: str, requests, levels, out: Path) -> dict:
    """Start one server, measure every concurrency level, stop it -> {concurrency: cell}."""
    argv, env = server_command(method_args(args, method), method, args.port)
    base = f"http://{HOST}:{args.port}"
    log = open(out / f"server-{method}.log", "w")
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    cells = {}
    try:
        try:
            bench.wait_healthy(base, lambda: proc.poll() is None)
        except RuntimeError as e:
            raise DFlowError(f"{method} server: {e}; see {out / f'server-{method}.log'}") from e
        start_s = time.perf_counter() - t0
        bench.chat(base, args.target, requests[0], 8)  # warm-up, not measured
        for c in levels:
            before = bench.spec_counters(bench.get(base + "/metrics"))
            run = bench.run_load(base, args.target, requests, c, args.max_new_tokens)
            after = bench.spec_counters(bench.get(base + "/metrics"))
            cells[c] = {"tokens_per_s": run.tokens_per_s, "num_tokens": run.tokens, "wall_s": run.wall_s,
                        "num_requests": len(requests), "server_start_s": start_s,
                        **bench.acceptance(bench.counter_delta(after, before)),
                        "texts": [o["text"] for o in run.outputs]}
            print(f"{method:7s} c={c}: {run.tokens_per_s:7.1f} tok/s  tau {_f(cells[c]['tau'])}", file=sys.stderr)
    finally:
        bench.stop_server(proc)
        log.close()
    return cells


def _f(x) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.2f}"


def run(args) -> int:
    levels = _levels(args.concurrency)
    methods = _names(args.methods, METHODS, "methods")
    methods = tuple(sorted(methods, key=lambda m: m != "ar"))  # ar first: the speedup and audit reference
    if args.num_prompts < 1 or args.max_new_tokens < 1:
        raise DFlowError("--num-prompts and --max-new-tokens must be >= 1")
    datasets, skipped = _load_datasets(_names(args.datasets or DEFAULT_DATASETS, DATASETS, "datasets"),
                                       args.num_prompts, {}, asked=args.datasets is not None,
                                       remedy="leave it out of --datasets (bench-serve reads packaged and hub "
                                              "datasets only)")
    requests = [[{"role": "user", "content": s.turns[0]}] for samples in datasets.values() for s in samples]
    for m in methods:
        server_command(method_args(args, m), m, args.port)  # fails now, not after an hour, on a bad target or drafter
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    raw = {m: _serve(args, m, requests, levels, out) for m in methods}
    results = {}
    for c in levels:
        results[c] = {}
        ref = raw.get("ar", {}).get(c)
        for m in methods:
            cell = dict(raw[m][c])
            texts = cell.pop("texts")
            if ref is not None:
                cell["speedup"] = cell["tokens_per_s"] / ref["tokens_per_s"] if ref["tokens_per_s"] else None
                cell["mismatches"] = sum(a != b for a, b in zip(texts, ref["texts"]))
            results[c][m] = cell
    meta = {"command": shlex.join(["dflow", *sys.argv[1:]]),
            "target": args.target, "drafter": args.drafter or "default",
            **({"dflash_drafter": args.dflash_drafter} if args.dflash_drafter else {}), "dtype": args.dtype,
            "datasets": ", ".join(datasets), "prompts_per_level": len(requests),
            "max_new_tokens": args.max_new_tokens, "cpus": args.cpus or "vLLM auto",
            "enforce_eager": args.enforce_eager, "bench_wall_s": round(time.perf_counter() - t0, 1)}
    paths = write_serving_report(out, results, meta, skipped)
    for c in levels:
        print(f"c={c}: " + "  ".join(f"{m} {results[c][m]['tokens_per_s']:.1f} tok/s "
                                     f"({_f(results[c][m].get('speedup'))}x, tau {_f(results[c][m]['tau'])})"
                                     for m in methods))
    print(f"report {paths['markdown']}")
    return 0
