"""`dflow train`: train a DFlash / DFlow drafter on a `dflow data` folder (see dflow.train)."""

from __future__ import annotations

import argparse
import os

from dflow.commands import add_device_arg
from dflow.targets import DEFAULT_TARGET
from dflow.train import TrainConfig, train
from dflow.pipeline import DEFAULT_LAYERS, DEFAULT_TARGET_LAYERS
from dflow.train.config import BLOCK_BIAS_STEPS, DEFAULT_DRAFT_VOCAB


def draft_vocab_arg(text: str) -> int:
    """`--draft-vocab N` or `full` (0: the whole vocabulary)."""
    if text == "full":
        return 0
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of ids or 'full', got {text!r}") from None


def loss_gamma_arg(text: str) -> float | None:
    """`--loss-gamma G` or `dflash` (None: DFlash's own, 7 for B = 16)."""
    if text == "dflash":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'dflash', got {text!r}") from None


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a drafter (DFlash: --rounds 0; DFlow: --rounds k)",
                       description="Train a drafter. Under torchrun (or `torchrun -m dflow.train`) it trains with DDP.")
    p.add_argument("--target", default=DEFAULT_TARGET, help="alias, local HF folder or hub id")
    p.add_argument("--data", required=True, help="a `dflow data` folder built for this target")
    p.add_argument("--extra-data", nargs="+", default=(), metavar="DIR", type=str,
                   help="more `dflow data` folders whose sequences are trained on too (e.g. the same prompts "
                        "answered at a temperature); the held-out slice stays --data's, and their sequences of "
                        "its held-out conversations are left out")
    p.add_argument("--out", required=True, help="run folder: checkpoint/, metrics.jsonl, and the drafter itself")
    p.add_argument("--init", default=None, help="start from this drafter folder (init-drafter or an earlier run)")
    p.add_argument("--rounds", type=int, default=2, help="k reject-conditioned rounds after round 0 (0 = DFlash)")
    p.add_argument("--no-relay", dest="relay", action="store_false", help="later rounds start from plain masks")
    steps = p.add_mutually_exclusive_group()
    steps.add_argument("--epochs", type=int, default=None, help="passes over the data (default 1)")
    steps.add_argument("--max-steps", type=int, default=None, help="optimizer steps")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint, with the run's own flags; "
                   "--dtype, --bf16 and --anchors-per-seq may change (the log says so)")
    p.add_argument("--resume-from", default=None, metavar="SNAPSHOT",
                   help="continue the run whose snapshot SNAPSHOT holds (scripts/snapshot_run.sh: its drafter and "
                        "step, no optimizer state) in a new OUT, with the run's own flags: the same step, schedule "
                        "and data order, a fresh optimizer whose rate ramps in again over --warmup steps; --dtype, "
                        "--bf16 and --anchors-per-seq may change (another machine)")
    p.add_argument("--layers", type=int, default=None, help=f"drafter layers of a fresh drafter (default {DEFAULT_LAYERS})")
    p.add_argument("--block-size", type=int, default=None, help="block size B (default 16, or --init's; with --init, its weights train on "
                        "blocks of B: none depends on B, so a drafter can be fitted to the block it will draft)")
    p.add_argument("--target-layers", type=int, default=None,
                   help=f"target layers a fresh drafter fuses, spread as DFlash spreads them (default "
                        f"{DEFAULT_TARGET_LAYERS}, or --layers when larger, at most the target's)")
    p.add_argument("--draft-vocab", type=draft_vocab_arg, default=None, metavar="N|full",
                   help="a fresh drafter scores only the N most frequent supervised tokens of --data's training "
                        f"split (a reduced draft vocabulary; default {DEFAULT_DRAFT_VOCAB}, or the full vocabulary "
                        "when it is not larger; full: the whole vocabulary); with --init, that drafter's "
                        "map is replaced so (its weights do not depend on it)")
    p.add_argument("--lr", type=float, default=TrainConfig.lr, help="peak learning rate (AdamW, warmup + cosine)")
    p.add_argument("--warmup", type=int, default=None, help="warmup steps (default 4%% of the run)")
    p.add_argument("--batch-size", type=int, default=TrainConfig.batch_size, help="sequences per process per micro-step")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    p.add_argument("--anchors-per-seq", type=int, default=TrainConfig.anchors_per_seq, help="blocks sampled per sequence")
    p.add_argument("--max-len", type=int, default=None,
                   help="longer sequences are truncated and counted (default: the target's context, at most 2048)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=TrainConfig.dtype, help="the target's weights")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=TrainConfig.bf16,
                   help="bfloat16 autocast for the drafter (default on)")
    add_device_arg(p, "training and the held-out evaluation")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the drafter's layers (faster, less memory; needs a C++ compiler; "
                        "the first step compiles for a minute or two)")
    p.add_argument("--layout", choices=("auto", "dense", "chunked"), default="auto",
                   help="the drafter's attention over a batch's blocks: dense, one masked call over every block "
                        "(fewer, larger kernels: a GPU's), or chunked, a few blocks at a time (less memory: a "
                        "CPU's); same loss and gradients (default auto: dense on CUDA)")
    p.add_argument("--block-bias", type=float, default=TrainConfig.block_bias, metavar="LOGIT",
                   help="training only: add LOGIT to the attention logits of each block's anchor key, falling "
                        "linearly to 0 (see --block-bias-steps) (draws a fresh drafter's draft positions to their anchor; "
                        "the trained drafter is plain DFlash; default %(default)s, 0: off)")
    p.add_argument("--block-bias-steps", type=int, default=None, metavar="N",
                   help=f"steps over which --block-bias falls to 0 (default {BLOCK_BIAS_STEPS}, at most half the run)")
    p.add_argument("--loss-gamma", type=loss_gamma_arg, default=TrainConfig.loss_gamma, metavar="G|dflash",
                   help="loss weight of block index k is exp(-(k-1)/gamma) (default %(default)s; dflash: DFlash's, "
                        "7 for B = 16; small: the first draft positions only)")
    p.add_argument("--loss", choices=("ce", "kl"), default="ce",
                   help="labels of the draft positions: ce, the data's tokens (DFlash); kl, the target's own "
                        "next-token distribution there (its final state through the head; one more target layer "
                        "output kept, or a `dflow features --last-state` cache)")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--stop-at", type=int, default=None, metavar="STEP",
                   help="checkpoint at STEP and exit, the schedule unchanged (a session's share of a long run: "
                        "rerun with --resume and a later --stop-at, or none, to go on)")
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
    cfg = TrainConfig(**{k: tuple(v) if k == "extra_data" else v for k, v in vars(args).items() if k in fields})
    rec = train(cfg, progress=args.progress)
    if rec and os.environ.get("RANK", "0") == "0":  # one summary line, also under torchrun
        rounds = ", ".join(f"r{q} {rec[f'loss_r{q}']:.3f}/{rec[f'acc_r{q}']:.2f}" for q in range(cfg.rounds + 1))
        print(f"trained {args.out}: step {rec['step']}, loss {rec['loss']:.4f} (round loss/accuracy: {rounds}), "
              f"{rec['tokens_per_s']:.0f} tokens/s")
    return 0
