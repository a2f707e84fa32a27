"""scripts/eval_heldout.py --teacher: in float32 the engine drafts exactly what the training rollout's
round 0 drafts at the same anchors of the same output (no train/inference mismatch), for the
full vocabulary and a reduced draft vocabulary."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from conftest import TINY_VOCAB, tiny_target, tiny_tokenizer
from dflow.engine import generate
from dflow.model import DFlowDrafter, config_for_target

spec = importlib.util.spec_from_file_location("eval_heldout", Path(__file__).parents[1] / "scripts" / "eval_heldout.py")
evt = importlib.util.module_from_spec(spec)
spec.loader.exec_module(evt)

B = 8


@pytest.mark.parametrize("arch, reduced", [("llama", False), ("qwen3", True)])
def test_engine_proposals_equal_the_teacher_forced_ones(arch, reduced):
    target = tiny_target(arch)
    d = DFlowDrafter(config_for_target(target.config, 2, B, mask_token_id=3)).init_weights(1, std=0.1).eval()
    if reduced:  # every other id: the -inf outside must map back the same way in both paths
        d.dflash.d2t = torch.arange(0, TINY_VOCAB, 2)
    proposer = evt.Recording(d, target, use_relay=False)
    proposer.start_recording()
    prompt = [5, 9, 17, 33, 12, 40, 7, 21]
    out = generate(target, prompt, proposer=proposer, block_size=B, max_new_tokens=40)
    ids, anchors = torch.tensor(prompt + out.token_ids), torch.tensor(proposer.anchors)
    drafted = [r for r in out.rounds if r.drafted]  # the last round may have no draft positions
    assert len(anchors) == len(drafted) > 4
    tf = evt.teacher_proposals(proposer, target, ids, anchors, chunk=3)  # chunks of 3 anchors: several
    for r, engine in enumerate(proposer.proposals):  # a shorter last block (the token cap) attends over fewer masks
        assert tf[r].tolist() == engine or len(engine) < B - 1
    limit = torch.tensor([min(len(p), len(ids) - 1 - s) for p, s in zip(proposer.proposals, proposer.anchors)])
    full = [r for r, p in enumerate(proposer.proposals) if len(p) == B - 1]
    assert len(full) >= len(drafted) - (B - 1)  # only the blocks the token cap shortens are left out
    assert evt.accepted_length(tf, ids, anchors, limit)[full].tolist() == [drafted[r].accepted for r in full]


def test_accepted_length_counts_leading_matches_within_the_limit():
    ids = torch.tensor([0, 1, 2, 3, 4, 5])
    anchors = torch.tensor([0, 2, 3])
    proposals = torch.tensor([[1, 2, 9], [3, 4, 5], [4, 5, 5]])
    assert accepted_length_of(proposals, ids, anchors, torch.tensor([3, 3, 2])) == [2, 3, 2]


def accepted_length_of(*args):
    return evt.accepted_length(*args).tolist()


def test_versus_teacher_reports_the_engine_and_the_teacher_on_held_out_examples():
    target = tiny_target("llama")
    d = DFlowDrafter(config_for_target(target.config, 2, B, mask_token_id=3)).init_weights(1, std=0.1)
    g = torch.Generator().manual_seed(0)
    held_out = []
    for n in (30, 41):
        ids = torch.randint(4, TINY_VOCAB, (n,), generator=g)
        mask = torch.arange(n) >= 10  # a 10-token prompt, then the reply
        held_out.append((ids, mask))
    rec = evt.versus_teacher(d, target, tiny_tokenizer(), held_out, prompts=2, tokens=24)
    assert rec["rounds"] >= 2 * 24 // B and rec["held_out_anchors"] == 19 + 30
    assert rec["same_proposal_share"] > 0.8  # all but the shortened last blocks are identical in float32
    assert 0 <= rec["teacher_accepted_all_held_out_anchors"] <= B - 1


def test_held_out_tau_drafts_blocks_of_the_size_asked(monkeypatch):
    """--block-size B reaches the engine (else the drafter's own B), and each round drafts at most B - 1."""
    from dflow.train import logs

    sizes, drafted = [], []

    def spy(*args, **kwargs):
        out = generate(*args, **kwargs)
        sizes.append(kwargs["block_size"])
        drafted.extend(r.drafted for r in out.rounds)
        return out

    monkeypatch.setattr(logs, "generate", spy)
    target = tiny_target("llama")
    d = DFlowDrafter(config_for_target(target.config, 2, B, mask_token_id=3)).init_weights(1, std=0.1).eval()
    example = (torch.tensor([5, 9, 17, 33, 12, 40, 7, 21]), torch.tensor([False] * 5 + [True] * 3))
    for block, want in ((None, B), (3, 3)):
        sizes.clear(), drafted.clear()
        rec = logs.held_out_tau(d, target, tiny_tokenizer(), [example], False, 12, block)
        assert sizes == [want] and max(drafted) == want - 1 and rec["eval_tau"] >= 1.0
        assert rec["eval_tokens"] == 12 and rec["eval_dtype"] == str(target.dtype).removeprefix("torch.")
