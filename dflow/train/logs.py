"""What a run records: per-step records (per-round loss, draft accuracy, accepted length),
metrics.jsonl, and tau of the real engine on held-out prompts."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from dflow import metrics
from dflow.engine import generate
from dflow.model import DFlowDrafter
from dflow.pipeline import Pipeline
from dflow.proposers import DrafterProposer
from dflow.train.dataset import Example, prompt_of
from dflow.train.rollout import STATS


def held_out_tau(drafter: DFlowDrafter, target, tokenizer, examples: list[Example], use_relay: bool,
                 max_new_tokens: int, block_size: int | None = None) -> dict:
    """tau of the real engine (greedy, on the target's device) on held-out prompts (docs/DESIGN.md, "Metrics"),
    drafting blocks of `block_size` (default: the drafter's)."""
    weight = target.get_input_embeddings().weight
    d = copy.deepcopy(drafter).to(weight.device, weight.dtype).eval()
    proposer = DrafterProposer(d, target, use_relay=use_relay and d.relay is not None)
    stops = Pipeline(target, tokenizer, d).stop_token_ids
    rounds = [generate(target, prompt_of(ex), proposer=proposer, block_size=block_size or d.cfg.block_size,
                       max_new_tokens=max_new_tokens, stop_token_ids=stops).rounds for ex in examples]
    return {"eval_tau": metrics.tau(rounds), "eval_tau_per_sample": metrics.tau_per_sample(rounds),
            "eval_method": "dflow" if proposer.relay_module is not None else "dflash",
            "eval_tokens": max_new_tokens, "eval_dtype": str(weight.dtype).removeprefix("torch.")}


class MetricsLog:
    """metrics.jsonl: one JSON record per line; a resumed run first drops records past its step
    (and a torn last line: the run was killed while appending it)."""

    def __init__(self, path: Path, resume_step: int | None, enabled: bool):
        self.path, self.enabled = path, enabled
        if enabled and resume_step is not None and path.exists():
            path.write_text(records_up_to(path, resume_step))

    def write(self, record: dict) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")


def records_up_to(path: Path, step: float) -> str:
    """The lines of a metrics.jsonl at `path` whose records are at `step` or before ("" if none)."""
    if not path.exists():
        return ""
    return "".join(line + "\n" for line in path.read_text().splitlines() if _step(line) <= step)


def _step(line: str) -> float:
    """A record's step; a torn line's is infinite (it is past any step)."""
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return float("inf")


def step_record(step: int, lr: float, stats: list[torch.Tensor], grad_norm: float, tokens: int, seconds: float) -> dict:
    """Per-round loss (mean over micro-steps of weighted CE / weight sum), draft accuracy (correct
    argmax over valid labels) over all draft indices and at index 1 alone (`acc1`: the first
    draft position, which decides most of tau), mean accepted length a, and live anchors."""
    total = torch.stack(stats).sum(0)  # [rounds+1, STATS]
    col = {name: i for i, name in enumerate(STATS)}
    losses = torch.stack([s[:, col["loss_sum"]] / s[:, col["weight_sum"]].clamp(min=1e-8) for s in stats]).mean(0)
    rec = {"step": step, "lr": lr, "loss": float(losses.sum()), "grad_norm": grad_norm, "tokens": tokens,
           "tokens_per_s": tokens / seconds}
    for q in range(total.shape[0]):
        anchors = float(total[q, col["anchors"]])
        rec[f"loss_r{q}"] = float(losses[q])
        rec[f"acc_r{q}"] = float(total[q, col["correct"]] / total[q, col["labels"]].clamp(min=1))
        rec[f"acc1_r{q}"] = float(total[q, col["correct_1"]] / total[q, col["labels_1"]].clamp(min=1))
        rec[f"accepted_r{q}"] = float(total[q, col["accepted"]]) / anchors if anchors else 0.0
        rec[f"anchors_r{q}"] = int(anchors)
    return rec
