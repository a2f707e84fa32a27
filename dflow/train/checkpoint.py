"""Training checkpoints: written atomically, read without unpickling anything.

Layout of `--out`:

    checkpoint/                 the last good checkpoint, replaced as one unit
        config.json             the drafter (model.save_drafter: DFlash layout + relay.*)
        model.safetensors
        optimizer.safetensors   AdamW moments and step counts, keyed `state.<param index>.<name>`
        train_state.json        step, optimizer param groups, the run's settings
    config.json, model.safetensors   hard links to the checkpoint's drafter: `dflow generate --drafter OUT`
    metrics.jsonl               one record per step (and per evaluation)

A new checkpoint is assembled in `.checkpoint-new/`, then swapped in by two renames; if a crash
falls between them, `.checkpoint-old/` is still whole and `find_checkpoint` returns it. The data
order and the anchors are pure functions of (seed, step), so the step is all the RNG state a
resumed run needs.

A snapshot (`write_snapshot`, scripts/snapshot_run.sh) is what outlives a lost machine in a few tens of
MB: the checkpoint's drafter in bf16, its train_state.json without the optimizer's moments, and the
metrics up to its step. `dflow train --resume-from SNAPSHOT` goes on with the same run from it
(`load_snapshot`): same step, schedule and data order, a fresh optimizer.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch.optim import Optimizer

from dflow.errors import DFlowError
from dflow.model import DFlowDrafter, load_drafter, save_drafter
from dflow.train.logs import records_up_to

CHECKPOINT = "checkpoint"
DRAFTER_FILES = ("config.json", "model.safetensors")


def find_checkpoint(out: Path) -> Path | None:
    for name in (CHECKPOINT, ".checkpoint-old"):
        if (out / name / "train_state.json").is_file():
            return out / name
    return None


def saved_step(path: Path) -> int:
    return json.loads((path / "train_state.json").read_text())["step"]


def save_checkpoint(out: Path, drafter: DFlowDrafter, optimizer: Optimizer, state: dict) -> Path:
    """Write drafter + optimizer + `state` (JSON-able; must hold "step") as `out/checkpoint`."""
    staging, final, old = out / ".checkpoint-new", out / CHECKPOINT, out / ".checkpoint-old"
    shutil.rmtree(staging, ignore_errors=True)
    save_drafter(drafter, staging)
    sd = optimizer.state_dict()
    tensors = {f"state.{i}.{k}": v.detach().cpu().contiguous() for i, s in sd["state"].items() for k, v in s.items()}
    save_file(tensors, str(staging / "optimizer.safetensors"))
    (staging / "train_state.json").write_text(json.dumps({**state, "param_groups": sd["param_groups"]}, indent=2))
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(staging, final)
    shutil.rmtree(old, ignore_errors=True)
    for name in DRAFTER_FILES:  # publish the drafter at the top of --out
        tmp = out / f".{name}.tmp"
        tmp.unlink(missing_ok=True)
        try:
            os.link(final / name, tmp)
        except OSError:
            shutil.copyfile(final / name, tmp)
        os.replace(tmp, out / name)
    return final


def _way_out(path: Path, drafter_whole: bool) -> str:
    """What to do when the checkpoint in `path` is broken: the other kept checkpoint, if any, else
    a new run (from this one's weights when they are whole)."""
    for kept in (path.parent / name for name in (CHECKPOINT, ".checkpoint-old")):
        if kept != path and (kept / "train_state.json").is_file():
            return f"the previous checkpoint {kept} is kept: remove {path} and rerun with --resume to continue from it"
    if drafter_whole:
        return (f"no earlier checkpoint is kept; its drafter is whole: --init {path} with another --out starts a new "
                "run from it (with a fresh optimizer)")
    return "no earlier checkpoint is kept: start again with another --out"


def _read(file: Path, read):
    try:
        return read(file)
    except (OSError, ValueError, SafetensorError) as e:
        raise DFlowError(f"{file} is truncated or unreadable ({str(e).splitlines()[0]}); "
                         f"{_way_out(file.parent, drafter_whole=True)}") from e


def load_checkpoint(path: Path) -> tuple[DFlowDrafter, dict, dict]:
    """-> (drafter in float32, optimizer state dict, train state). A broken file is one DFlowError
    that names it and says how to go on."""
    try:
        drafter = load_drafter(path).train()
    except DFlowError as e:
        raise DFlowError(f"{e}; {_way_out(path, drafter_whole=False)}") from e
    state = _read(path / "train_state.json", lambda f: json.loads(f.read_text()))
    if not isinstance(state, dict) or not {"step", "config", "world_size", "param_groups"} <= set(state):
        raise DFlowError(f"{path / 'train_state.json'} is not a training state; {_way_out(path, drafter_whole=True)}")
    tensors = _read(path / "optimizer.safetensors", lambda f: load_file(str(f)))
    opt_state: dict[int, dict] = {}
    for key, value in tensors.items():
        _, index, name = key.split(".", 2)
        opt_state.setdefault(int(index), {})[name] = value
    return drafter, {"state": opt_state, "param_groups": state.pop("param_groups")}, state


def write_snapshot(run: Path, dest: Path, dtype: torch.dtype = torch.bfloat16) -> int | None:
    """Copy `run`'s latest drafter (in `dtype`), its checkpoint's train state less the optimizer's
    param groups (`load_snapshot` reads it) and its metrics.jsonl up to that step to `dest`; -> the step
    (None: `run` holds no checkpoint, only a drafter: then all its metrics are copied and no state)."""
    ckpt = find_checkpoint(run)
    drafter = load_drafter(ckpt or run)
    dest.mkdir(parents=True, exist_ok=True)
    save_drafter(drafter, dest, dtype=dtype)
    state_file, step = dest / "train_state.json", None
    state_file.unlink(missing_ok=True)
    if ckpt is not None:
        state = json.loads((ckpt / "train_state.json").read_text())
        state.pop("param_groups", None)
        step = state["step"]
        state_file.write_text(json.dumps(state, indent=2))
    # the steps logged after the checkpoint are redone on resume
    (dest / "metrics.jsonl").write_text(records_up_to(run / "metrics.jsonl", float("inf") if step is None else step))
    return step


def load_snapshot(path: Path) -> tuple[DFlowDrafter, dict]:
    """-> (drafter in float32, train state: step, config, world_size) of a `write_snapshot` folder."""
    state_file = path / "train_state.json"
    if not state_file.is_file():
        raise DFlowError(f"--resume-from {path}: no train_state.json there, so not a snapshot of a run's step "
                         "(scripts/snapshot_run.sh writes one); --init starts a new run from a drafter's weights")
    state = _read(state_file, lambda f: json.loads(f.read_text()))
    if not isinstance(state, dict) or not {"step", "config", "world_size"} <= set(state):
        raise DFlowError(f"{state_file} is not a training state (step, config, world_size)")
    return load_drafter(path).train(), state
