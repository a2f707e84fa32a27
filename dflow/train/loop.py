"""The training loop: the drafter to start from, optimizer and schedule, DDP, micro-steps,
the non-finite guard, checkpoints and logging. The loss is rollout.py's; which sequences a
process sees is sharding.py's; what gets recorded is logs.py's.
"""

from __future__ import annotations

import math
import signal
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, fields, replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from dflow.attention import sdpa_backends
from dflow.errors import DFlowError, QuietInterrupt
from dflow.model import DFlowDrafter, check_fits_target, load_drafter
from dflow.pipeline import DEFAULT_LAYERS, draft_vocab_of, init_drafter
from dflow.targets import describe_device, load_target, warn_slow_bf16
from dflow.train.checkpoint import find_checkpoint, load_checkpoint, load_snapshot, save_checkpoint, saved_step
from dflow.train.config import BLOCK_BIAS_STEPS, DEFAULT_DRAFT_VOCAB, LAYOUTS, PREDATING, RESUME_FREE, RUN_KEYS, TrainConfig
from dflow.train.dataset import load_train_data
from dflow.train.features import open_features
from dflow.train.logs import MetricsLog, held_out_tau, records_up_to, step_record
from dflow.train.rollout import Rollout, TargetParts, context_forward
from dflow.train.sharding import DataOrder, Dist


def learning_rate(step: int, total: int, peak: float, warmup: int, fresh_at: int = 0) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to 0 at `total`. An optimizer made fresh at
    step `fresh_at` > 0 (`--resume-from`: no moments) ramps the schedule's rate in again over `warmup` steps."""
    if step < warmup:
        return peak * (step + 1) / warmup
    rate = peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))
    return rate * min(1.0, (step - fresh_at + 1) / warmup) if fresh_at and warmup else rate


def block_bias(step: int, steps: int, peak: float) -> float:
    """`--block-bias` at `step`: `peak` falling linearly to 0 at `steps` (`--block-bias-steps`, default
    BLOCK_BIAS_STEPS or half the run, the shorter), 0 after: the drafter ends as plain DFlash, and decoding never sees the bias."""
    return peak * max(0.0, 1 - step / max(1, steps))


def draft_vocab_size(cfg: TrainConfig, target) -> int | None:
    """A fresh drafter's draft vocabulary: --draft-vocab N, or DEFAULT_DRAFT_VOCAB when the target's
    vocabulary is larger; None for the full one (--draft-vocab full, or a small vocabulary)."""
    size = cfg.draft_vocab if cfg.draft_vocab is not None else DEFAULT_DRAFT_VOCAB
    return size if 0 < size < target.config.vocab_size else None


def build_drafter(cfg: TrainConfig, target, tokenizer, examples=()) -> DFlowDrafter:
    """A fresh drafter (with `--draft-vocab`, its map counted over `examples`, the training
    split), or `--init`'s (with `--draft-vocab`, re-mapped the same way: its scores are rows of
    the target's frozen head, so nothing else changes; with `--block-size`, re-blocked: no weight
    depends on the block size); given a relay when relay training asks
    for one."""
    wants_relay = cfg.rounds > 0 and cfg.relay
    if cfg.init is None:
        return init_drafter(target, tokenizer, cfg.layers or DEFAULT_LAYERS, cfg.block_size or 16, cfg.seed, relay=wants_relay,
                            target_layers=cfg.target_layers, draft_vocab=draft_vocab_of(examples, target, draft_vocab_size(cfg, target)))
    drafter = load_drafter(cfg.init)
    if cfg.block_size is not None and cfg.block_size != drafter.cfg.block_size:
        # no weight depends on B: the same weights, trained (and then drafting) on blocks of cfg.block_size
        reblocked = DFlowDrafter(replace(drafter.cfg, block_size=cfg.block_size))
        reblocked.load_state_dict(drafter.state_dict())
        drafter = reblocked.to(next(drafter.parameters()).dtype)
    for name, want, have in (("layers", cfg.layers, drafter.cfg.num_hidden_layers),
                             ("target-layers", cfg.target_layers, len(drafter.cfg.target_layer_ids))):
        if want is not None and want != have:
            raise DFlowError(f"--{name} {want} differs from --init's {have}; leave it out")
    if cfg.draft_vocab is not None:
        d2t = draft_vocab_of(examples, target, draft_vocab_size(cfg, target))  # None: the full vocabulary
        mapped = DFlowDrafter(replace(drafter.cfg, draft_vocab_size=0 if d2t is None else d2t.numel())).init_weights(cfg.seed)
        keys = mapped.load_state_dict({k: v for k, v in drafter.state_dict().items() if k != "dflash.d2t"}, strict=False)
        if keys.unexpected_keys or set(keys.missing_keys) - {"dflash.d2t"}:
            raise DFlowError(f"--init {cfg.init}: its weights do not fit a re-mapped drafter ({keys})")
        if d2t is not None:
            mapped.dflash.d2t.copy_(d2t)
        drafter = mapped
    if wants_relay and drafter.relay is None:  # a DFlash drafter gets an untrained (no-op) relay
        grown = DFlowDrafter(replace(drafter.cfg, relay=True)).init_weights(cfg.seed)
        grown.dflash.load_state_dict(drafter.dflash.state_dict())
        drafter = grown
    return drafter


def saved_split(state: dict) -> tuple[int, int, int]:
    """A checkpoint's split of its global batch: (--batch-size, --grad-accum, processes)."""
    return state["config"]["batch_size"], state["config"].get("grad_accum", 1), state["world_size"]


class Trainer:
    """One run: everything is set up in __init__ (or restored from `--out`'s checkpoint), then `run`."""

    def __init__(self, cfg: TrainConfig, env: Dist, progress: bool = True):
        self.cfg, self.env, self.progress = cfg, env, progress
        self.out = Path(cfg.out)
        existing = next(p for p in (self.out, *self.out.parents) if p.exists())
        if not existing.is_dir():
            raise DFlowError(f"--out {self.out}: {existing} is a file, not a folder")
        ckpt = find_checkpoint(self.out)
        if cfg.resume and ckpt is None:
            raise DFlowError(f"--resume: {self.out} holds no checkpoint")
        if not cfg.resume and ckpt is not None:
            raise DFlowError(f"{self.out} already holds a training checkpoint; pass --resume to continue it "
                             "or use another --out")
        self.target, self.tokenizer = load_target(cfg.target, cfg.dtype, env.device)
        if cfg.bf16:
            warn_slow_bf16(env.device, "--bf16", "--dtype float32 --no-bf16")
        context = self.target.config.max_position_embeddings
        if cfg.max_len is not None and cfg.max_len > context:
            raise DFlowError(f"--max-len {cfg.max_len} exceeds the target's context of {context} positions")
        self.data = load_train_data(cfg.data, self.target, self.tokenizer, cfg.max_len or min(2048, context),
                                    cfg.eval_samples, cfg.extra_data)
        self.say(self.data.summary())

        self.start, opt_state = 0, None
        self.fresh_at = 0  # the step whose optimizer started without moments (--resume-from), 0: the run's start
        if ckpt is not None:
            self.drafter, opt_state, state = load_checkpoint(ckpt)
            changes = self._check_resumable(state)
            self.start, self.fresh_at = state["step"], state.get("fresh_at", 0)
            self.say(f"resuming {ckpt} at step {self.start}{changes}")
        elif cfg.resume_from is not None:
            self.drafter, state = load_snapshot(Path(cfg.resume_from))
            changes = self._check_resumable(state)
            self.start = self.fresh_at = state["step"]
            resumed = (f"resuming the run of {cfg.resume_from} at step {self.start} from its weights, with a fresh "
                       f"optimizer (a snapshot keeps no optimizer state){changes}")
        else:
            self.drafter = build_drafter(cfg, self.target, self.tokenizer, self.data.train)
        check_fits_target(self.drafter.cfg, self.target.config)
        self.drafter.to(env.device).train()
        self.optimizer = torch.optim.AdamW(self.drafter.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                                           weight_decay=cfg.weight_decay)
        if opt_state is not None:
            self.optimizer.load_state_dict(opt_state)
        self.rollout = Rollout(self.drafter, TargetParts(self.target, self.drafter.cfg.target_layer_ids),
                               cfg.rounds, cfg.relay, compile=cfg.compile, loss_gamma=cfg.loss_gamma,
                               dense=LAYOUTS[cfg.layout]).to(env.device)
        self.model = self.rollout
        self.needs_kv = self.rollout.use_relay and cfg.rounds > 0  # the verifier pass runs over the trajectory KV
        self.features = None
        if cfg.feature_cache is not None:
            self.features = open_features(cfg.feature_cache, cfg.data, self.target, self.drafter.cfg.target_layer_ids)
            if cfg.loss == "kl" and not self.features.key["last_state"]:
                raise DFlowError(f"--loss kl reads the target's final states, which {cfg.feature_cache} does not hold "
                                 "(build the cache with `dflow features --last-state`, or leave --feature-cache out)")
            if self.needs_kv:
                self.say("--feature-cache: relay rounds need the target's KV of each trajectory, so its context "
                         "forward runs anyway and the cache is not read (it serves --rounds 0 and --no-relay)")
        if env.world > 1:  # relay parameters go unused in some steps (nothing relayed), with --no-relay and at k = 0;
            # a drafter without them uses every parameter, and DDP skips its search of the graph for unused ones
            self.model = DistributedDataParallel(self.rollout, device_ids=[env.device] if env.device.type == "cuda"
                                                 else None, find_unused_parameters=self.drafter.relay is not None)
        self.order = DataOrder(self.data.train, cfg, env)
        self.total = cfg.max_steps or (cfg.epochs or 1) * self.order.steps_per_epoch
        self.warmup = cfg.warmup if cfg.warmup is not None else round(0.04 * self.total)
        if cfg.resume_from is not None:
            if self.start >= self.total:
                raise DFlowError(f"--resume-from {cfg.resume_from}: the run is at step {self.start} of {self.total}, "
                                 "nothing left to train (a larger --max-steps goes on)")
            self.say(f"{resumed}: its rate ramps in again over {self.warmup} steps")
        self.out.mkdir(parents=True, exist_ok=True)
        metrics = self.out / "metrics.jsonl"
        if cfg.resume_from is not None and env.main:  # the run's records up to the snapshot (steps past it are redone)
            metrics.write_text(records_up_to(Path(cfg.resume_from) / "metrics.jsonl", self.start))
        self.log = MetricsLog(metrics, self.start if ckpt is not None else None, env.main)
        self.evaluate = env.main and cfg.eval_samples > 0  # held-out tau, by the engine on this device
        # SIGTERM / SIGINT (a scheduler, torchrun passing one on, Ctrl-C): checkpoint the last finished step,
        # then stop. From optimizer.step() until that step is logged (and saved when due) the drafter is
        # ahead of `done`: a signal there waits for the step to be recorded (`updating`, `pending`).
        self.done, self.saved = self.start, self.start if ckpt is not None else None
        self.updating, self.pending = False, None

    def say(self, message: str) -> None:
        if self.env.main:
            print(f"[dflow train] {message}", file=sys.stderr, flush=True)

    def _check_resumable(self, state: dict) -> str:
        """Refuse a resume whose RUN_KEYS settings or global batch differ from `state`'s; those in
        RESUME_FREE may differ, and so may the global batch's split (-> what changed, for the log)."""
        saved = state["config"]
        # a key the checkpoint predates: what it was trained with then (PREDATING), else the default
        defaults = {f.name: f.default for f in fields(TrainConfig)} | PREDATING
        def value(v):  # JSON keeps a tuple setting as a list
            return tuple(v) if isinstance(v, list) else v

        def change(k):
            return f"--{k.replace('_', '-')} {saved.get(k, defaults[k])!r} -> {getattr(self.cfg, k)!r}"

        keys = [k for k in RUN_KEYS if value(saved.get(k, defaults[k])) != value(getattr(self.cfg, k))]
        changed = [change(k) for k in keys if k in RESUME_FREE]
        diff = [change(k) for k in keys if k not in RESUME_FREE]
        # the batches are pure functions of (seed, step, global batch): any split of the same global batch over
        # micro-batches and processes resumes the same run (sharding.DataOrder), e.g. on another number of cores
        split, now = saved_split(state), (self.cfg.batch_size, self.cfg.grad_accum, self.env.world)
        if math.prod(split) != math.prod(now):
            diff.append(f"global batch {math.prod(split)} (--batch-size {split[0]} x --grad-accum {split[1]} x "
                        f"{split[2]} processes) -> {math.prod(now)} (--batch-size {now[0]} x "
                        f"--grad-accum {now[1]} x {now[2]} processes)")
        if diff:
            how = "--resume-from with other settings than the snapshot's" if self.cfg.resume_from else \
                "--resume with other settings than the checkpoint's"
            raise DFlowError(f"{how} ({', '.join(diff)})")
        anew = "" if split == now else (f" (the global batch split anew: {split[0]} x {split[1]} micro-steps x "
                                        f"{split[2]} processes -> {now[0]} x {now[1]} x {now[2]})")
        return anew + "".join(f"; {c}" for c in changed)

    def run(self) -> dict:
        cfg, rec = self.cfg, {}
        self.say(f"{self.total} steps of {self.order.global_batch} sequences, rounds {cfg.rounds}, relay "
                 f"{'on' if self.rollout.use_relay else 'off'}, block {self.drafter.cfg.block_size}, "
                 f"{self.drafter.cfg.num_hidden_layers} drafter layers fusing target layers "
                 f"{list(self.drafter.cfg.target_layer_ids)}, device {describe_device(self.env.device)}")
        end = self.total if cfg.stop_at is None else cfg.stop_at
        if cfg.stop_at is not None and not self.start < end <= self.total:  # before any work is spent
            raise DFlowError(f"--stop-at {cfg.stop_at}: the run is at step {self.start} of {self.total}; give a "
                             f"step after {self.start} and at most {self.total}")
        if self.start == 0 and cfg.eval_every:
            self.eval_tau(0)
        bar = tqdm(total=self.total, initial=self.start, desc="dflow train", unit="step",
                   disable=not (self.progress and self.env.main))
        with self.checkpoint_on_signal():
            for step in range(self.start, end):
                rec = self.train_step(step)  # leaves `updating` set: the drafter is at step + 1
                self.log.write(rec)
                bar.update(1)
                bar.set_postfix(loss=f"{rec['loss']:.3f}", tok_s=f"{rec['tokens_per_s']:.0f}")
                self.done = done = rec["step"]
                if done % cfg.save_every == 0 or done == end:  # end: the last step, or --stop-at's
                    self.save(done)
                self.updating = False
                if self.pending:
                    self.interrupt(self.pending)
                if (cfg.eval_every and done % cfg.eval_every == 0) or done == self.total:
                    self.eval_tau(done)
        bar.close()
        self.say(f"done: {self.out}" if end == self.total else
                 f"stopped at step {end} of {self.total} (--stop-at): rerun with --resume to go on")
        return rec

    def train_step(self, step: int) -> dict:
        """Micro-steps (context forward, rollout, backward), clipping, the finite check, the update."""
        cfg, t0, c0 = self.cfg, time.perf_counter(), time.process_time()
        lr = learning_rate(step, self.total, cfg.lr, self.warmup, self.fresh_at)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.rollout.block_bias = block_bias(step, cfg.block_bias_steps or min(BLOCK_BIAS_STEPS, self.total // 2), cfg.block_bias)
        stats, backward_loss = [], 0.0
        for micro in range(cfg.grad_accum):
            batch = self.order.batch(step, micro).to(self.env.device)
            sync = self.env.world == 1 or micro == cfg.grad_accum - 1
            with sdpa_backends(self.env.device):  # on a GPU: not cuDNN's, which plans anew for each shape
                features, teacher, cache = self.context(batch, step, micro)
                with (nullcontext() if sync else self.model.no_sync()), \
                        torch.autocast(self.env.device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
                    loss, micro_stats = self.model(batch, features, cache, teacher)
                (loss / cfg.grad_accum).backward()
            backward_loss += float(loss.detach())
            stats.append(micro_stats.cpu())
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), cfg.grad_clip))
        rec = step_record(step + 1, lr, stats, grad_norm, self.order.num_tokens(step), time.perf_counter() - t0)
        rec["cpu_s"] = self.cpu_seconds(time.process_time() - c0)
        if cfg.block_bias:
            rec["block_bias"] = self.rollout.block_bias
        if not all(map(math.isfinite, (backward_loss, rec["loss"], grad_norm))):
            kept = find_checkpoint(self.out)
            where = f"the last good checkpoint is {kept} (step {saved_step(kept)})" if kept else "no checkpoint yet"
            raise DFlowError(f"step {step + 1}: non-finite loss or gradient (loss {rec['loss']}, gradient norm "
                             f"{grad_norm}, round losses {[rec[f'loss_r{q}'] for q in range(cfg.rounds + 1)]}); "
                             f"training stopped before this update; {where}")
        self.updating = True  # cleared by run() once this step is logged (and saved when due)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return rec

    @contextmanager
    def checkpoint_on_signal(self):
        """While training: SIGTERM or SIGINT checkpoints the last finished step and stops the run
        (`interrupt`); the handlers before are restored after. Only the main thread can set them."""
        def handler(signum, frame):
            name = signal.Signals(signum).name
            if self.updating:
                self.pending = name  # run() stops once the step under way is recorded
            else:
                self.interrupt(name)
        wanted = (signal.SIGTERM, signal.SIGINT)
        try:
            before = {s: signal.signal(s, handler) for s in wanted}
        except ValueError:  # not the main thread
            before = {}
        try:
            yield
        finally:
            for s, h in before.items():
                signal.signal(s, h)

    def interrupt(self, name: str) -> None:
        """Checkpoint the last finished step (the main process), then stop with KeyboardInterrupt
        (`dflow train` exits with 130 and says how to go on)."""
        stop = KeyboardInterrupt if self.env.main else QuietInterrupt  # the main process says why, once
        if self.done == self.start and self.saved is None:
            raise stop(f"{name} before step 1 had finished: nothing to keep")
        self.updating = True  # a second signal (Ctrl-C twice) waits for this save
        if self.saved != self.done:
            self.save(self.done)
        raise stop(f"{name}: stopped after step {self.done} of {self.total}, which the checkpoint "
                   "holds; rerun with --resume to go on")

    def cpu_seconds(self, mine: float) -> float:
        """The step's CPU seconds summed over the processes (core-seconds: what the learning curve's
        compute axis counts, whatever the cores, their sharing or pauses)."""
        if self.env.world == 1:
            return mine
        total = torch.tensor([mine], dtype=torch.float64, device=self.env.device)
        dist.all_reduce(total)
        return float(total)

    def context(self, batch, step: int, micro: int):
        """The batch's raw context features [b, T, F] (read from the feature cache when one is given and
        no KV is needed), the target's final states [b, T, hidden] (`--loss kl`, else None) and the
        target's KV of the trajectories (relay rounds only, else None)."""
        kl = self.cfg.loss == "kl"
        if self.features is None or self.needs_kv:
            layers = tuple(self.drafter.cfg.target_layer_ids) + ((self.target.config.num_hidden_layers - 1,) if kl else ())
            features, cache = context_forward(self.target, batch.ids, layers, keep_cache=self.needs_kv)
        else:
            rows = [self.data.train_source[i] for i in self.order.members(step, micro)]
            features, cache = self.features.batch(rows, batch.lengths.tolist(), last=kl).to(self.env.device), None
        if not kl:
            return features, None, cache
        hidden = self.target.config.hidden_size
        return features[..., :-hidden], features[..., -hidden:], cache

    def save(self, step: int) -> None:
        if self.env.main:
            save_checkpoint(self.out, self.drafter, self.optimizer,
                            {"step": step, "config": asdict(self.cfg), "world_size": self.env.world,
                             "fresh_at": self.fresh_at})
        self.saved = step

    def eval_tau(self, step: int) -> None:
        if self.evaluate:
            rec = {"step": step, **held_out_tau(self.drafter, self.target, self.tokenizer, self.data.held_out,
                                                self.rollout.use_relay, self.cfg.eval_tokens)}
            self.log.write(rec)
            self.say(f"step {step}: held-out tau {rec['eval_tau']:.3f} ({rec['eval_method']})")


def train(cfg: TrainConfig, progress: bool = True) -> dict:
    """Run (or resume) a training run; returns the last step's record."""
    cfg.validate()
    env = Dist.setup(cfg.device)
    try:
        return Trainer(cfg, env, progress).run()
    finally:
        env.close()
