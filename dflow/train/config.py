"""The settings of a training run, validated into one clear error per bad value."""

from __future__ import annotations

import math
from dataclasses import dataclass

from dflow.drafter import check_block_size
from dflow.errors import DFlowError
from dflow.targets import DEVICES, DTYPES

# Settings a resumed run must share with the run it continues (the step count may change: --max-steps;
# so may the split of the global batch, batch_size x grad_accum x processes, which the resume checks as one).
RUN_KEYS = ("target", "data", "extra_data", "init", "rounds", "relay", "layers", "target_layers", "block_size", "lr", "warmup",
            "anchors_per_seq", "max_len", "dtype", "bf16", "seed", "eval_samples",
            "weight_decay", "grad_clip", "draft_vocab", "block_bias", "block_bias_steps", "loss_gamma",
            "loss")
# The RUN_KEYS a resume may change, said in the log: how this machine computes the run (the target's dtype, the
# drafter's autocast) and how densely each sequence's blocks are drawn (--anchors-per-seq: the same anchors and
# more, or fewer, as `sample_anchors` takes a prefix of one draw). Which is cheaper depends on the CPU: where
# the target's float32 context forward dominates a step, more blocks a forward cost less per unit of gradient
# noise (scripts/probe_anchor_noise.py; docs/training.md, "Anchors a sequence, by machine").
RESUME_FREE = ("dtype", "bf16", "anchors_per_seq")
# What a checkpoint written before a setting existed was trained with (its resume check reads these).
PREDATING = {"extra_data": (), "draft_vocab": 0, "block_bias": 0.0, "block_bias_steps": None, "loss_gamma": None, "loss": "ce"}
LOSSES = ("ce", "kl")
LAYOUTS = {"auto": None, "dense": True, "chunked": False}  # --layout -> Rollout.dense (None: dense on CUDA)
DEFAULT_DRAFT_VOCAB = 8192  # a fresh drafter's draft vocabulary (ids), when the target's is larger
BLOCK_BIAS_STEPS = 300  # --block-bias falls to 0 over this many steps, or half the run when shorter


@dataclass(frozen=True)
class TrainConfig:
    target: str
    data: str
    out: str
    extra_data: tuple[str, ...] = ()  # more `dflow data` folders, training sequences only (dflow.train.dataset)
    init: str | None = None  # a drafter folder to start from (init-drafter or an earlier run)
    rounds: int = 2  # k: reject-conditioned rounds after round 0 (0 = DFlash training)
    relay: bool = True  # False: rounds from plain masks (the "self-conditioning only" ablation)
    epochs: int | None = None  # default 1 when max_steps is not given
    max_steps: int | None = None
    stop_at: int | None = None  # checkpoint at this step and exit; the schedule still runs to max_steps (--resume goes on)
    resume: bool = False
    resume_from: str | None = None  # a snapshot (checkpoint.write_snapshot) of this run: its step, a fresh optimizer
    layers: int | None = None  # default pipeline.DEFAULT_LAYERS (2), or --init's
    target_layers: int | None = None  # target layers fused; default pipeline.default_target_layers, or --init's
    block_size: int | None = None  # default 16, or --init's
    draft_vocab: int | None = None  # a fresh drafter's vocabulary: the N most frequent supervised ids (None:
    #   DEFAULT_DRAFT_VOCAB, capped at the target's; 0: the full vocabulary)
    lr: float = 1.2e-3
    warmup: int | None = None  # steps; default 4% of the run
    batch_size: int = 2  # sequences per process per micro-step
    grad_accum: int = 1
    anchors_per_seq: int = 128
    max_len: int | None = None  # default: the target's context, at most 2048
    dtype: str = "bfloat16"  # the target's weights
    bf16: bool = True  # bfloat16 autocast for the drafter
    device: str = "auto"  # where training and the held-out evaluation run (auto: CUDA when present)
    compile: bool = False  # torch.compile the drafter's layers around their attention (same values)
    layout: str = "auto"  # the rollout's drafter attention and verify layout (LAYOUTS; same loss and gradients)
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    save_every: int = 200
    eval_every: int = 0  # steps between held-out tau evaluations (0: only at the end)
    eval_samples: int = 4  # held-out sequences (0: no evaluation)
    eval_tokens: int = 64  # new tokens generated per held-out prompt
    seed: int = 0
    block_bias: float = 4.0  # attention-logit bias on each block's anchor key, annealed to 0 (0: off)
    block_bias_steps: int | None = None  # steps over which --block-bias falls to 0 (default: BLOCK_BIAS_STEPS or
    #   half the run, the shorter)
    loss_gamma: float | None = 1.0  # the loss decay over block indices (None: DFlash's, 7 for B = 16)
    loss: str = "ce"  # ce: the data's tokens as labels; kl: the target's distribution at each draft position
    feature_cache: str | None = None  # a `dflow features` folder read instead of the target's context forward

    def validate(self) -> None:
        checks = [
            (self.rounds >= 0, f"--rounds must be >= 0, got {self.rounds}"),
            (not (self.resume and self.resume_from), "give --resume (OUT's checkpoint) or --resume-from (a snapshot), "
             "not both"),
            (not (self.extra_data and self.feature_cache), "--feature-cache serves --data alone; leave out --extra-data"),
            (self.epochs is None or self.max_steps is None, "give --epochs or --max-steps, not both"),
            (self.epochs is None or self.epochs >= 1, f"--epochs must be >= 1, got {self.epochs}"),
            (self.max_steps is None or self.max_steps >= 1, f"--max-steps must be >= 1, got {self.max_steps}"),
            (self.stop_at is None or self.stop_at >= 1, f"--stop-at must be >= 1, got {self.stop_at}"),
            (self.layers is None or self.layers >= 1, f"--layers must be >= 1, got {self.layers}"),
            (self.target_layers is None or self.target_layers >= 1,
             f"--target-layers must be >= 1, got {self.target_layers}"),
            (self.draft_vocab is None or self.draft_vocab >= 0, f"--draft-vocab must be >= 1, got {self.draft_vocab}"),
            (math.isfinite(self.lr) and self.lr > 0, f"--lr must be > 0, got {self.lr}"),
            (self.warmup is None or self.warmup >= 0, f"--warmup must be >= 0, got {self.warmup}"),
            (self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}"),
            (self.grad_accum >= 1, f"--grad-accum must be >= 1, got {self.grad_accum}"),
            (self.anchors_per_seq >= 1, f"--anchors-per-seq must be >= 1, got {self.anchors_per_seq}"),
            (self.max_len is None or self.max_len >= 3, f"--max-len must be >= 3, got {self.max_len}"),
            (self.dtype in DTYPES, f"--dtype must be float32 or bfloat16, got {self.dtype}"),
            (self.device in DEVICES or self.device.startswith("cuda:"),
             f"--device must be one of {', '.join(DEVICES)}, got {self.device}"),
            (self.weight_decay >= 0, f"--weight-decay must be >= 0, got {self.weight_decay}"),
            (math.isfinite(self.block_bias) and self.block_bias >= 0,
             f"--block-bias must be >= 0, got {self.block_bias}"),
            (self.block_bias_steps is None or self.block_bias_steps >= 1,
             f"--block-bias-steps must be >= 1, got {self.block_bias_steps}"),
            (self.loss_gamma is None or (math.isfinite(self.loss_gamma) and self.loss_gamma > 0),
             f"--loss-gamma must be > 0, got {self.loss_gamma}"),
            (self.loss in LOSSES, f"--loss must be one of {', '.join(LOSSES)}, got {self.loss!r}"),
            (self.layout in LAYOUTS, f"--layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}"),
            (self.grad_clip > 0, f"--grad-clip must be > 0, got {self.grad_clip}"),
            (self.save_every >= 1, f"--save-every must be >= 1, got {self.save_every}"),
            (self.eval_every >= 0, f"--eval-every must be >= 0, got {self.eval_every}"),
            (self.eval_samples >= 0, f"--eval-samples must be >= 0, got {self.eval_samples}"),
            (self.eval_tokens >= 1, f"--eval-tokens must be >= 1, got {self.eval_tokens}"),
        ]
        for ok, message in checks:
            if not ok:
                raise DFlowError(message)
        if self.block_size is not None:
            check_block_size(self.block_size, "--block-size")
