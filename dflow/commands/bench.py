"""`dflow bench`: the paper's benchmark suite (tau, acceptance, speedup) -> results.json, report.md, PNGs.

Methods: `ar` (the target alone, through the engine: the speedup and audit reference), `dflash`
(the drafter with relay off), `dflow` (relay on), `pld` (transformers' prompt lookup, timed as
dflow/bench/pld.py says). `--ablation relay` runs ar, dflow-relay-off and dflow on one checkpoint.
`--variant LABEL=METHOD@DIR` adds a drafter method on another checkpoint under its own label, so
several trained drafters compare in one interleaved run (the Table-1 reproduction);
`LABEL=METHOD:B@DIR` drafts that label's blocks of B (block sizes compared in one run). At T = 0 every
output is audited against ar's. A dataset asked for by --datasets that cannot be had here is an
error before anything runs (the default list skips it, with reason). Every finished prompt is
journaled in OUT/progress.jsonl: `--resume` continues an interrupted run (and may raise
--num-prompts); a bench splits over processes by --datasets or by prompt (`--shard K/N`), and
`--merge DIR` joins the shares; `--report-only` reports what is journaled so far, generating nothing.
"""

from __future__ import annotations

import math
import re
import sys
import time
from pathlib import Path
from typing import Callable

from dflow.bench.journal import FILE as JOURNAL_FILE, Journal
from dflow.bench.provenance import journal_settings, run_meta
from dflow.bench.runner import BENCH_METHODS, ENGINE_METHOD, BenchConfig, run_bench
from dflow.bench.summary import overhead_section, relay_ablation_section, runtime_breakdown
from dflow.commands import add_device_arg, parse_shard
from dflow.commands.generate import add_sampling_args, sampling_params
from dflow.datasets import DATASETS, DatasetUnavailable, load_dataset
from dflow.drafter import check_block_size
from dflow.errors import DFlowError
from dflow.model import check_fits_target, load_drafter
from dflow.pipeline import Pipeline
from dflow.report import add_overall, write_report
from dflow.targets import DEFAULT_TARGET, DTYPES, resolve_device

DEFAULT_DATASETS = "humaneval,gsm8k,mt-bench"
DEFAULT_METHODS = "ar,dflash,dflow,pld"
ABLATION_METHODS = ("ar", "dflow-relay-off", "dflow")
VARIANT_METHODS = ("dflash", "dflow")
VARIANT_DEFAULT_METHODS = "ar,pld"
LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9+._-]*")


def add_parser(sub) -> None:
    b = sub.add_parser("bench", help="benchmark ar / dflash / dflow / pld: tau, acceptance, speedup, report")
    b.add_argument("--target", default=DEFAULT_TARGET, help="alias, local HF folder or hub id")
    b.add_argument("--drafter", default=None, help="drafter folder (default: the one shipped for the target)")
    b.add_argument("--datasets", default=None, help=f"comma-separated, from {', '.join(DATASETS)} (default "
                                                    f"{DEFAULT_DATASETS}, less those not installed here)")
    b.add_argument("--methods", default=None, help=f"comma-separated, from {', '.join(BENCH_METHODS)} "
                                                   f"(default {DEFAULT_METHODS})")
    b.add_argument("--num-prompts", type=int, default=10, help="first N prompts of each dataset")
    b.add_argument("--max-new-tokens", type=int, default=256)
    b.add_argument("--block-size", type=int, default=None, help="default: the drafter's")
    b.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16")
    b.add_argument("--out", required=True, help="output folder")
    b.add_argument("--data-file", action="append", default=[], metavar="NAME=PATH",
                   help="a local JSONL for a dataset (repeatable)")
    b.add_argument("--ablation", choices=("relay",), default=None,
                   help="relay: the same DFlow checkpoint with relay on vs off (Table 3)")
    b.add_argument("--variant", action="append", default=[], metavar="LABEL=METHOD[:B]@DIR",
                   help="also run METHOD (dflash or dflow) with the drafter in DIR, reported as LABEL, in "
                        "blocks of B when given (else --block-size's) "
                        f"(repeatable; --methods then defaults to {VARIANT_DEFAULT_METHODS})")
    b.add_argument("--resume", action="store_true",
                   help=f"continue the run journaled in OUT/{JOURNAL_FILE} (same settings; more prompts allowed)")
    b.add_argument("--merge", action="append", default=[], metavar="DIR",
                   help="first copy the finished prompts journaled in run folder DIR (same settings, e.g. "
                        "another --datasets share of a split bench) into this run (repeatable)")
    b.add_argument("--shard", default=None, metavar="K/N",
                   help="run only prompt i of each dataset with i %% N == K (0 <= K < N); the N shares, "
                        "each with its own --out, are then joined with --merge")
    b.add_argument("--report-only", action="store_true",
                   help="generate nothing: report the prompts the journal holds (with --resume and/or --merge), "
                        "e.g. while the shares of a split bench are still running")
    b.add_argument("--runtime-breakdown", action="store_true", help="print the per-round cost split (Figure 3)")
    b.add_argument("--no-audit", action="store_true", help="skip the lossless audit against ar at T = 0")
    add_device_arg(b, "every method")
    add_sampling_args(b)
    b.set_defaults(func=run)


def _names(text: str, known, what: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if not names:
        raise DFlowError(f"--{what} is empty")
    unknown = [n for n in names if n not in known]
    if unknown:
        raise DFlowError(f"unknown {what[:-1]} {unknown[0]!r}; choose from {', '.join(known)}")
    return names


def _data_files(pairs: list[str], datasets: tuple[str, ...]) -> dict[str, str]:
    files = {}
    for pair in pairs:
        name, sep, path = pair.partition("=")
        if not sep or not name or not path:
            raise DFlowError(f"--data-file takes NAME=PATH, got {pair!r}")
        if name not in datasets:
            raise DFlowError(f"--data-file {name}: {name} is not in --datasets")
        files[name] = path
    return files


def _methods(args) -> tuple[str, ...]:
    if args.ablation == "relay":
        if args.methods is not None or args.variant:
            raise DFlowError("--ablation relay sets the methods (ar, dflow-relay-off, dflow); drop --methods "
                             "and --variant")
        return ABLATION_METHODS
    default = VARIANT_DEFAULT_METHODS if args.variant else DEFAULT_METHODS
    methods = _names(args.methods or default, tuple(BENCH_METHODS), "methods")
    return tuple(sorted(methods, key=lambda m: m != "ar"))  # ar first: the audit's reference


def _variants(pairs: list[str], methods: tuple[str, ...]) -> dict[str, tuple[str, Path, int | None]]:
    """--variant LABEL=METHOD[:B]@DIR -> label -> (method, drafter folder, block size or None: --block-size's)."""
    out = {}
    for pair in pairs:
        label, sep, rest = pair.partition("=")
        method, at, path = rest.partition("@")
        method, colon, block = method.partition(":")
        if not (sep and at and label and path) or (colon and not block.isdigit()):
            raise DFlowError(f"--variant takes LABEL=METHOD@DIR or LABEL=METHOD:B@DIR, got {pair!r}")
        if not LABEL.fullmatch(label):
            raise DFlowError(f"--variant label {label!r}: use letters, digits and + . _ -")
        if label in methods or label in out:
            raise DFlowError(f"--variant label {label!r} is used twice")
        if method not in VARIANT_METHODS:
            raise DFlowError(f"--variant {label}: method must be dflash or dflow, got {method!r}")
        if colon:
            check_block_size(int(block), f"--variant {label}: the block size")
        if not Path(path).is_dir():
            raise DFlowError(f"--variant {label}: drafter folder {path} does not exist")
        out[label] = (method, Path(path), int(block) if colon else None)
    return out


def _lineup(pipe: Pipeline, methods: tuple[str, ...], variants: dict[str, tuple[str, Path, int | None]], dtype: str):
    """label -> (BENCH_METHODS key, pipeline): the variants share the target, each with its own drafter."""
    lineup = {m: (m, pipe) for m in methods}
    loaded: dict[Path, Pipeline] = {}
    for label, (method, path, _) in variants.items():
        if path not in loaded:
            drafter = load_drafter(path, pipe.target.dtype).to(pipe.target.device)
            check_fits_target(drafter.cfg, pipe.target.config)
            loaded[path] = Pipeline(pipe.target, pipe.tokenizer, drafter, f"drafter {path}")
        lineup[label] = (method, loaded[path])
        loaded[path].proposer(method)  # fails now, not mid-run, on a relay-less checkpoint
    return lineup


def _check(args) -> None:
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise DFlowError(f"--out {args.out} is a file, not a folder")
    if args.num_prompts < 1:
        raise DFlowError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.max_new_tokens < 1:
        raise DFlowError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.block_size is not None:
        check_block_size(args.block_size, "--block-size")
    if args.shard is not None:
        parse_shard(args.shard)
    if args.report_only and not (args.resume or args.merge):
        raise DFlowError("--report-only reports a journal: add --resume (this --out's) and/or --merge DIR")
    if args.drafter is not None and not Path(args.drafter).is_dir():
        raise DFlowError(f"drafter folder {args.drafter} does not exist")
    resolve_device(args.device)  # before any dataset or model is loaded


def _runs(args) -> Callable[[int], bool] | None:
    """Which prompt indices this process generates: all (None), its --shard, or none (--report-only)."""
    if args.report_only:
        return lambda index: False
    if args.shard:
        k, n = parse_shard(args.shard)
        return lambda index: index % n == k
    return None


def _load_datasets(names, num_prompts: int, files: dict[str, str], asked: bool,
                   remedy: str = "give it a local JSONL with --data-file {name}=PATH, or leave it out of "
                                 "--datasets"):
    """-> (dataset -> samples, dataset -> one-line reason it was skipped). Only a default list
    (`asked` False) skips a dataset that cannot be had here, with a printed note; one asked for by
    name, or given a --data-file, is an error before anything is generated."""
    loaded, skipped = {}, {}
    for name in names:
        try:
            loaded[name] = load_dataset(name, num_prompts, files.get(name))
        except DatasetUnavailable as e:
            reason = e.reason.removeprefix(f"{name}: ")
            if name in files:
                raise DFlowError(f"--data-file {name}={files[name]}: {reason}") from None
            if asked:
                raise DFlowError(f"--datasets {name}: {reason}; {remedy.format(name=name)}") from None
            skipped[name] = e.reason
            print(f"[dflow] skipped {e.reason}", file=sys.stderr)
    if not loaded:
        raise DFlowError("no dataset could be loaded: " + "; ".join(skipped.values()))
    return loaded, skipped


def run(args) -> int:
    _check(args)
    names = _names(args.datasets or DEFAULT_DATASETS, DATASETS, "datasets")
    methods = _methods(args)
    files = _data_files(args.data_file, names)
    params = sampling_params(args)
    datasets, skipped = _load_datasets(names, args.num_prompts, files, asked=args.datasets is not None)

    variants = _variants(args.variant, methods)
    needs_drafter = any(m in ENGINE_METHOD for m in methods)
    pipe = Pipeline.load(args.target, args.drafter, args.dtype, need_drafter=needs_drafter, device=args.device)
    if pipe.drafter_note:
        print(f"[dflow] {pipe.drafter_note}", file=sys.stderr)
    for m in methods:
        if m in ENGINE_METHOD:
            pipe.proposer(ENGINE_METHOD[m])  # fails now, not mid-run, on a relay-less checkpoint
    lineup = _lineup(pipe, methods, variants, args.dtype)
    drafters = [p.drafter for _, p in lineup.values() if p.drafter is not None]
    block = args.block_size or (drafters[0].cfg.block_size if drafters else 16)
    labels = methods + tuple(variants)
    cfg = BenchConfig(labels, args.max_new_tokens, block, params,
                      audit=params.temperature == 0 and not args.no_audit and "ar" in methods,
                      block_sizes={label: b for label, (_, _, b) in variants.items() if b is not None})
    journal = Journal(args.out, journal_settings(args, cfg, variants), args.resume)
    for folder in args.merge:
        print(f"[dflow] merged {journal.merge(folder)} finished prompts from {folder}", file=sys.stderr)
    if journal.num_saved:
        print(f"[dflow] resuming: {journal.num_saved} prompts already done in {journal.path}", file=sys.stderr)

    t0 = time.perf_counter()
    try:
        results, overhead = run_bench(pipe, datasets, cfg, lineup, journal, _runs(args))
    except KeyboardInterrupt:
        raise KeyboardInterrupt(f"finished prompts are kept in {journal.path}; rerun the same command with "
                                "--resume to continue") from None
    wall_s = time.perf_counter() - t0
    if not results:
        raise DFlowError(f"{journal.path} holds no finished prompt of {', '.join(datasets)} to report")
    for name in datasets.keys() - results.keys():
        skipped[name] = f"{name}: no prompt of it finished in this run or its journal (--report-only / --shard)"
    o = overhead.as_dict()
    full = add_overall(results)
    sections = [overhead_section(o)]
    if {"dflow", "dflow-relay-off"} <= set(cfg.methods):
        sections.insert(0, relay_ablation_section(full))
    meta = run_meta(args, cfg, pipe, datasets, o, wall_s, lineup, journal.num_saved)
    paths = write_report(args.out, results, skipped, meta, sections)

    _print_summary(full, skipped, o, wall_s, paths["markdown"], args.runtime_breakdown)
    return 0


def _print_summary(full, skipped: dict, overhead: dict, wall_s: float, report: Path, breakdown: bool) -> None:
    for m, cell in full["overall"].items():
        mism = "n/a" if cell.get("mismatches") is None else cell["mismatches"]
        print(f"{m:16s} tau {cell['tau']:.2f}  speedup {_x(cell.get('speedup'))}  "
              f"{cell['tokens_per_s']:.1f} tok/s  mismatches {mism}")
    if breakdown:
        print(runtime_breakdown(full))
    for name, reason in skipped.items():
        print(f"skipped {name}: {reason.removeprefix(f'{name}: ')}")
    print(f"harness overhead {overhead['percent_of_round_time']:.2f}% of round time | bench {wall_s:.1f} s | "
          f"report {report}")


def _x(v: float | None) -> str:
    return "n/a" if v is None or not math.isfinite(v) else f"{v:.2f}x"
