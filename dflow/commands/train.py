"""`dflow train`: train a DFlash / DFlow drafter on a `dflow data` folder (see dflow.train)."""

from __future__ import annotations

import argparse
import os

from dflow.commands import add_device_arg
from dflow.targets import DEFAULT_TARGET
from dflow.train import TrainConfig, train


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a drafter (DFlash: --rounds 0; DFlow: --rounds k)",
                       description="Train a drafter. Under torchrun (or `torchrun -m dflow.train`) it trains with DDP.")
    p.add_argument("--target", default=DEFAULT_TARGET, help="alias, local HF folder or hub id")
    p.add_argument("--data", required=True, help="a `dflow data` folder built for this target")
    p.add_argument("--out", required=True, help="run folder: checkpoint/, metrics.jsonl, and the drafter itself")
    p.add_argument("--init", default=None, help="start from this drafter folder (init-drafter or an earlier run)")
    p.add_argument("--rounds", type=int, default=2, help="k reject-conditioned rounds after round 0 (0 = DFlash)")
    p.add_argument("--no-relay", dest="relay", action="store_false", help="later rounds start from plain masks")
    steps = p.add_mutually_exclusive_group()
    steps.add_argument("--epochs", type=int, default=None, help="passes over the data (default 1)")
    steps.add_argument("--max-steps", type=int, default=None, help="optimizer steps")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    p.add_argument("--layers", type=int, default=None, help="drafter layers of a fresh drafter (default 5)")
    p.add_argument("--block-size", type=int, default=None, help="block size B of a fresh drafter (default 16)")
    p.add_argument("--target-layers", type=int, default=None,
                   help="target layers a fresh drafter fuses, spread as DFlash spreads them (default: --layers)")
    p.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="a fresh drafter scores only the N most frequent supervised tokens of --data's training "
                        "split (a reduced draft vocabulary; default: the full vocabulary)")
    p.add_argument("--lr", type=float, default=6e-4, help="peak learning rate (AdamW, warmup + cosine)")
    p.add_argument("--warmup", type=int, default=None, help="warmup steps (default 4%% of the run)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per process per micro-step")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    p.add_argument("--anchors-per-seq", type=int, default=32, help="blocks sampled per sequence")
    p.add_argument("--max-len", type=int, default=None,
                   help="longer sequences are truncated and counted (default: the target's context, at most 2048)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the target's weights")
    p.add_argument("--bf16", action="store_true", help="bfloat16 autocast for the drafter")
    add_device_arg(p, "training and the held-out evaluation")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the drafter's layers (faster, less memory; needs a C++ compiler; "
                        "the first step compiles for a minute or two)")
    p.add_argument("--block-bias", type=float, default=0.0, metavar="LOGIT",
                   help="training only: add LOGIT to the attention logits of each block's anchor key, falling "
                        "linearly to 0 (see --block-bias-steps) (draws a fresh drafter's draft positions to their anchor; "
                        "the trained drafter is plain DFlash)")
    p.add_argument("--block-bias-steps", type=int, default=None, metavar="N",
                   help="steps over which --block-bias falls to 0 (default: half the run)")
    p.add_argument("--loss-gamma", type=float, default=None,
                   help="loss weight of block index k is exp(-(k-1)/gamma) (default: DFlash's, 7 for B = 16; "
                        "small: the first draft positions only)")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--save-every", type=int, default=200, help="checkpoint every N steps (and at the end)")
    p.add_argument("--eval-every", type=int, default=0, help="held-out tau every N steps (0: at the end only)")
    p.add_argument("--eval-samples", type=int, default=4, help="held-out sequences for tau (0: none)")
    p.add_argument("--eval-tokens", type=int, default=64, help="tokens generated per held-out prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--feature-cache", default=None, metavar="DIR",
                   help="a `dflow features` folder for --data: its features replace the target's context forward "
                        "(with --rounds 0 or --no-relay; relay rounds still need the target's KV)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.set_defaults(func=run_train)


def run_train(args: argparse.Namespace) -> int:
    fields = set(TrainConfig.__dataclass_fields__)
    cfg = TrainConfig(**{k: v for k, v in vars(args).items() if k in fields})
    rec = train(cfg, progress=args.progress)
    if rec and os.environ.get("RANK", "0") == "0":  # one summary line, also under torchrun
        rounds = ", ".join(f"r{q} {rec[f'loss_r{q}']:.3f}/{rec[f'acc_r{q}']:.2f}" for q in range(cfg.rounds + 1))
        print(f"trained {args.out}: step {rec['step']}, loss {rec['loss']:.4f} (round loss/accuracy: {rounds}), "
              f"{rec['tokens_per_s']:.0f} tokens/s")
    return 0
