"""Where a bench run's figures come from: what its journal must agree on to be resumed or merged,
and the run's metadata in results.json / report.md (the command line spelled out, versions,
machine, device, audit)."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shlex
from pathlib import Path

import torch
import transformers

from dflow.bench.runner import ENGINE_METHOD, BenchConfig
from dflow.pipeline import Pipeline, default_drafter_dir
from dflow.targets import describe_device, file_sha256


def weights_sha(folder: Path | None) -> str | None:
    """A drafter's identity in the journal: a retrained checkpoint in the same folder must not resume."""
    weights = folder / "model.safetensors" if folder else None
    if weights is None or not weights.exists():
        return None
    return file_sha256(weights)[:16]


def journal_settings(args, cfg: BenchConfig, variants) -> dict:
    """What a resumed run must share with the journaled one (not --num-prompts: it may grow; not
    --drafter when only variants use drafters, so a newly shipped default keeps such runs resumable)."""
    settings = {"target": args.target, "dtype": args.dtype, "methods": list(cfg.methods),
                "variants": {k: [m, str(p), weights_sha(p)] + ([b] if b else []) for k, (m, p, b) in variants.items()},
                "max_new_tokens": cfg.max_new_tokens, "block_size": cfg.block_size,
                "sampling": [args.temperature, args.top_k, args.top_p, args.verify, args.seed],
                "data_files": sorted(args.data_file)}
    if any(m in ENGINE_METHOD for m in cfg.methods if m not in variants):  # --drafter drafts, not only variants
        drafter = Path(args.drafter) if args.drafter else default_drafter_dir(args.target)
        settings.update(drafter=args.drafter, drafter_sha=weights_sha(drafter))
    return settings


def command_line(args) -> str:
    """The run as a command line, every option spelled out (defaults resolved), except defaulted
    --datasets and --methods: left out, a rerun asks for the default lists again."""
    skip = {"command", "func", "data_file", "ablation", "runtime_breakdown", "no_audit", "methods", "variant",
            "resume", "merge", "report_only"}
    parts = ["dflow", "bench"]
    for key, value in vars(args).items():
        if key not in skip and value is not None:
            parts += [f"--{key.replace('_', '-')}", str(value)]
    parts += [x for f in args.data_file for x in ("--data-file", f)]
    parts += ["--methods", args.methods] if args.methods else []
    parts += [x for v in args.variant for x in ("--variant", v)]
    parts += ["--ablation", args.ablation] if args.ablation else []
    parts += [x for d in args.merge for x in ("--merge", d)]
    parts += [f"--{k.replace('_', '-')}" for k in ("runtime_breakdown", "no_audit", "report_only")
              if getattr(args, k)]
    return shlex.join(parts)


def audit_note(cfg: BenchConfig, args) -> str:
    if cfg.audit:
        return "on: every method's ids compared with ar's for the same prompt and turn (T = 0)"
    if args.no_audit:
        return "off (--no-audit)"
    if "ar" not in cfg.methods:
        return "off: ar was not run"
    return "off: T > 0, sampled outputs differ from ar's by design"


def run_meta(args, cfg: BenchConfig, pipe: Pipeline, datasets, overhead: dict, wall_s: float, lineup,
             resumed: int) -> dict:
    drafters = {label: p.drafter_note for label, (_, p) in lineup.items() if p is not pipe}
    device = pipe.target.device
    return {
        "command": command_line(args),
        "target": args.target,
        "drafter": pipe.drafter_note or "none",
        **({"variants": drafters} if drafters else {}),
        "resumed_prompts": resumed,
        "methods": ", ".join(cfg.methods),
        "datasets": ", ".join(datasets),
        "dtype": args.dtype,
        "device": str(device),
        "max_new_tokens": cfg.max_new_tokens,
        "block_size": cfg.block_size,
        "sampling": {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
                     "rule": args.verify, "seed": args.seed},
        "audit": audit_note(cfg, args),
        "versions": {"dflow": importlib.metadata.version("dflow"), "torch": torch.__version__,
                     "transformers": transformers.__version__, "python": platform.python_version()},
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "hardware": describe_device(device)},
        "bench_wall_s": round(wall_s, 2),
        "harness_overhead": overhead,
    }
