"""Copy a trained drafter into the package as a target's default drafter, in bfloat16.

    python scripts/ship_drafter.py runs/c --target smollm2-135m [--block-size B] [--note "how it was trained"]

Writes dflow/assets/drafters/<target>/ (config.json, model.safetensors, README.md with the run's
settings and last held-out tau), which `dflow generate`, `dflow bench` and `make demo` then use
when no --drafter is given. Checks that the copy loads and fits the target before replacing anything.
--block-size sets the block the shipped drafter drafts by default (its config's `block_size`), when
decode speed chose another than the one it was trained with (docs/training.md, "Depth and block
size"); the README names both.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

from dflow.drafter import check_block_size
from dflow.model import check_fits_target, load_drafter, save_drafter
from dflow.targets import ALIASES, DEFAULT_TARGET, load_target

ASSETS = Path(__file__).resolve().parents[1] / "dflow" / "assets" / "drafters"


def run_summary(run: Path) -> str:
    lines = []
    state = run / "checkpoint" / "train_state.json"
    if state.exists():
        cfg = json.loads(state.read_text()).get("config", {})
        lines.append("Training settings: " + ", ".join(f"{k}={v}" for k, v in cfg.items() if v is not None))
    metrics = run / "metrics.jsonl"
    if metrics.exists():
        evals = [json.loads(line) for line in metrics.read_text().splitlines() if "eval_tau" in line]
        if evals:
            e = evals[-1]
            lines.append(f"Held-out tau at step {e['step']} ({e.get('eval_method', '?')}): {e['eval_tau']:.3f}")
    return "\n\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", help="a drafter folder (a `dflow train --out` folder)")
    p.add_argument("--target", default=DEFAULT_TARGET, choices=sorted(ALIASES))
    p.add_argument("--block-size", type=int, default=None, help="the block it drafts by default (default: the run's)")
    p.add_argument("--note", default="", help="a paragraph for the shipped README.md")
    args = p.parse_args()

    run = Path(args.run)
    drafter = load_drafter(run, torch.float32)
    trained = drafter.cfg.block_size
    if args.block_size is not None:
        check_block_size(args.block_size, "--block-size")
        drafter.cfg = dataclasses.replace(drafter.cfg, block_size=args.block_size)  # what config.json records
    target, _ = load_target(args.target, torch.bfloat16)
    check_fits_target(drafter.cfg, target.config)
    out = save_drafter(drafter, ASSETS / args.target, dtype=torch.bfloat16)
    assert load_drafter(out, torch.bfloat16).cfg.block_size == drafter.cfg.block_size  # the shipped copy loads
    n = sum(t.numel() for t in drafter.parameters())
    (out / "README.md").write_text("\n\n".join(filter(None, [
        f"# Default drafter for {args.target}",
        f"Copied from `{run}` by `python scripts/ship_drafter.py {run} --target {args.target}"
        f"{f' --block-size {args.block_size}' if args.block_size else ''}` in bfloat16: "
        f"{drafter.cfg.num_hidden_layers} layers, block {drafter.cfg.block_size}"
        f"{f' (trained with {trained}; chosen by decode speed)' if trained != drafter.cfg.block_size else ''}, relay "
        f"{'on' if drafter.relay is not None else 'off'}, {n / 1e6:.1f}M parameters.",
        args.note, run_summary(run), "How it was trained and what it measures: docs/results.md.",
    ])) + "\n")
    size = sum(f.stat().st_size for f in out.iterdir()) / 1e6
    print(f"shipped {out} ({size:.1f} MB)")


if __name__ == "__main__":
    main()
