"""The reduced draft vocabulary (dflow.vocab) on tiny random targets, float32: picking the ids, the
checkpoint's map (round trip, bad maps refused, full-vocabulary checkpoints unchanged), the
training loss (a map of every id is the full loss; the linear layout equals the reference), and
decoding (the drafter scores only its map's rows; greedy equals AR, rounds as a masked full drafter).
Sampling through the lossless harness is in test_sampling_engine.py, vLLM in test_vllm_vocab.py,
`init-drafter` / `train --draft-vocab` in test_train_loop.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import TINY_VOCAB, tiny_target
from dflow.engine import generate
from dflow.errors import DFlowError
from dflow.model import DFlowDrafter, config_for_target, load_drafter, save_drafter
from dflow.proposers import DrafterProposer
from dflow.train.rollout import STATS, Rollout, TargetParts, context_forward
from dflow.vocab import MAP_KEY, count_supervised, pick_draft_vocab, to_draft, to_target_logits
from dflow.train.batching import collate, sample_anchors
from test_train_rollout import drafter_for, random_batch

B = 8
MAP = torch.tensor([0, 2, 4, 5, 6, 7, 9, 13, 17, 20, 25, 31, 40, 47, 52, 63])  # [16] of 64 target ids


def reduced(drafter: DFlowDrafter, d2t: torch.Tensor = MAP) -> DFlowDrafter:
    """The same weights with a reduced draft vocabulary d2t."""
    cfg = drafter.cfg.__class__(**{**drafter.cfg.__dict__, "draft_vocab_size": d2t.numel()})
    out = DFlowDrafter(cfg)
    state = {**drafter.state_dict(), "dflash.d2t": d2t}
    out.load_state_dict(state)
    return out.eval()


def test_the_most_frequent_supervised_ids_ties_by_id():
    examples = [(torch.tensor([9, 5, 5, 7, 3, 3, 3]), torch.tensor([0, 1, 1, 1, 1, 1, 0], dtype=torch.bool)),
                (torch.tensor([8, 7, 2]), torch.tensor([1, 1, 1], dtype=torch.bool))]
    counts = count_supervised(examples, 10)  # supervised: 5 5 7 3 3 | 8 7 2; 9 and the last 3 are prompt
    assert counts.tolist() == [0, 0, 1, 2, 0, 2, 0, 2, 1, 0]
    assert pick_draft_vocab(counts, 3).tolist() == [3, 5, 7]  # 3, 5, 7 twice each
    assert pick_draft_vocab(counts, 5).tolist() == [2, 3, 5, 7, 8]  # then 2 and 8 (once): lower ids first
    assert pick_draft_vocab(counts, 6).tolist() == [0, 2, 3, 5, 7, 8]  # unseen ids fill up from 0
    with pytest.raises(DFlowError, match="--draft-vocab must be in 1..10"):
        pick_draft_vocab(counts, 11)
    with pytest.raises(DFlowError, match="outside the target's vocabulary"):
        count_supervised(examples, 8)


def test_ids_map_both_ways():
    ids = torch.tensor([[0, 1, 63, 5], [52, 53, 2, 64 - 1]])
    draft, inside = to_draft(ids, MAP)
    assert inside.tolist() == [[True, False, True, True], [True, False, True, True]]
    assert torch.equal(MAP[draft][inside], ids[inside]) and (draft[~inside] == 0).all()
    logits = torch.randn(3, MAP.numel())
    full = to_target_logits(logits, MAP, TINY_VOCAB)  # [3, 64]
    assert torch.equal(full[:, MAP], logits) and full.isneginf().sum() == 3 * (TINY_VOCAB - MAP.numel())
    assert torch.equal(MAP[logits.argmax(-1)], full.argmax(-1))


def test_round_trip_keeps_the_map(tmp_path):
    target = tiny_target("llama")
    drafter = reduced(drafter_for(target))
    save_drafter(drafter, tmp_path / "d", dtype=torch.bfloat16)
    stored = load_file(str(tmp_path / "d" / "model.safetensors"))
    assert stored[MAP_KEY].dtype == torch.int64  # not cast with the weights
    assert torch.equal(stored[MAP_KEY] + torch.arange(MAP.numel()), MAP)  # SpecForge's / vLLM's offsets
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["dflow_config"]["draft_vocab_size"] == MAP.numel() and "draft_vocab_size" not in cfg
    loaded = load_drafter(tmp_path / "d")
    assert loaded.cfg.draft_vocab_size == MAP.numel() and torch.equal(loaded.dflash.d2t, MAP)
    assert torch.equal(load_drafter(tmp_path / "d", relay=False).dflash.d2t, MAP)


@pytest.mark.parametrize("relay", [True, False])
def test_a_full_vocabulary_checkpoint_has_no_new_keys(tmp_path, relay):
    target = tiny_target("llama")
    drafter = DFlowDrafter(config_for_target(target.config, 2, B, mask_token_id=3, relay=relay))
    assert drafter.dflash.d2t is None and "dflash.d2t" not in drafter.state_dict()
    save_drafter(drafter, tmp_path / "d")
    keys = set(load_file(str(tmp_path / "d" / "model.safetensors")))
    dflash_keys = {k for k in keys if not k.startswith("relay.")}
    assert dflash_keys == set(drafter.dflash.state_dict()) and MAP_KEY not in keys
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert "draft_vocab_size" not in json.dumps(cfg)
    assert ("dflow_config" in cfg) == relay  # a plain DFlash drafter: the reference layout exactly


@pytest.mark.parametrize("change, message", [
    (lambda d2t: d2t.flip(0), "distinct target ids in ascending order"),
    (lambda d2t: torch.cat([d2t[:1], d2t[:-1]]), "distinct target ids in ascending order"),
    (lambda d2t: d2t + 1, r"ids outside the vocabulary 0..63"),
    (lambda d2t: d2t[:-1], "holds 15 ids, but dflow_config.draft_vocab_size is 16"),
    (lambda d2t: d2t.float(), "must be a 1-D integer tensor"),
    (None, "no d2t map is stored"),
])
def test_bad_maps_are_refused_in_one_line(tmp_path, change, message):
    save_drafter(reduced(drafter_for(tiny_target("llama"))), tmp_path / "d")
    weights = tmp_path / "d" / "model.safetensors"
    sd = load_file(str(weights))
    d2t = sd.pop(MAP_KEY) + torch.arange(MAP.numel())
    if change is not None:
        new = change(d2t)
        sd[MAP_KEY] = new - torch.arange(new.numel()).to(new.dtype)
    save_file(sd, str(weights))
    with pytest.raises(DFlowError, match=message) as e:
        load_drafter(tmp_path / "d")
    assert "\n" not in str(e.value) and str(weights) in str(e.value)


def test_rollout_with_every_id_in_the_map_is_the_full_loss():
    target = tiny_target("llama")
    batch = random_batch(anchors=4, seed=3)
    out = []
    for d in (drafter_for(target), reduced(drafter_for(target), torch.arange(TINY_VOCAB))):
        feats, cache = context_forward(target, batch.ids, d.cfg.target_layer_ids, keep_cache=True)
        out.append(Rollout(d, TargetParts(target, d.cfg.target_layer_ids), 2, True)(batch, feats, cache))
    torch.testing.assert_close(out[1][0], out[0][0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out[1][1], out[0][1], atol=1e-5, rtol=0)


def test_reduced_loss_is_the_full_loss_over_a_head_masked_outside_the_map():
    """Sequences of map ids only: the reduced loss, statistics and gradients equal the full
    vocabulary's through a head whose rows outside the map score -1e4 (softmax weight 0)."""
    target = tiny_target("llama")
    g = torch.Generator().manual_seed(4)
    seqs = []
    for n in (40, 27, 33):
        mask = torch.zeros(n, dtype=torch.bool)
        mask[6:] = True
        seqs.append((MAP[torch.randint(0, MAP.numel(), (n,), generator=g)], mask))
    batch = collate(seqs, [sample_anchors(m, 6, g) for _, m in seqs])
    masked_head = torch.nn.Linear(32, TINY_VOCAB).requires_grad_(False)
    masked_head.weight.copy_(target.lm_head.weight)
    masked_head.bias.fill_(-1e4)
    masked_head.bias[MAP] = 0
    results = []
    for d2t in (MAP, None):
        d = reduced(drafter_for(target)).train() if d2t is not None else drafter_for(target)
        feats, cache = context_forward(target, batch.ids, d.cfg.target_layer_ids, keep_cache=True)
        if d2t is None:
            target.lm_head = masked_head  # the drafter's head only: the features and the verifier pass are done
        loss, stats = Rollout(d, TargetParts(target, d.cfg.target_layer_ids), 2, True)(batch, feats, cache)
        loss.backward()
        results.append((loss.detach(), stats, {n: p.grad for n, p in d.named_parameters() if p.grad is not None}))
    (loss, stats, grads), (loss_ref, stats_ref, grads_ref) = results
    torch.testing.assert_close(loss, loss_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stats, stats_ref, atol=1e-4, rtol=1e-5)
    assert (stats[:, STATS.index("correct")] > 0).all()  # proposals matched: mapped back to target ids
    for name in grads_ref:
        torch.testing.assert_close(grads[name], grads_ref[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("rounds, relay", [(0, False), (2, True)])
def test_reduced_linear_layout_equals_the_dense_reference(rounds, relay):
    """The chunked layout and the dense reference agree with a map; labels outside the map weigh
    nothing (weight sum below the full run's) but still count as labels (misses in accuracy)."""
    target = tiny_target("llama")
    batch = random_batch(lengths=(40, 27, 33), anchors=6, seed=2)
    results = []
    for reference in (True, False, None):  # None: the full vocabulary, chunked
        d = drafter_for(target) if reference is None else reduced(drafter_for(target)).train()
        feats, cache = context_forward(target, batch.ids, d.cfg.target_layer_ids, keep_cache=relay)
        loss, stats = Rollout(d, TargetParts(target, d.cfg.target_layer_ids), rounds, relay,
                              bool(reference))(batch, feats, cache)
        loss.backward()
        results.append((loss.detach(), stats, {n: p.grad for n, p in d.named_parameters() if p.grad is not None}))
    (loss_ref, stats_ref, grads_ref), (loss, stats, grads), (_, stats_full, _) = results
    torch.testing.assert_close(loss, loss_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stats, stats_ref, atol=1e-4, rtol=1e-5)
    assert grads.keys() == grads_ref.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], grads_ref[name], atol=1e-5, rtol=1e-4, msg=name)
    w, labels = STATS.index("weight_sum"), STATS.index("labels")
    assert stats[0, labels] == stats_full[0, labels] and stats[0, w] < stats_full[0, w]


class MaskedProposer(DrafterProposer):
    """The full-vocabulary drafter with its logits outside a map set to -inf: what the reduced
    drafter must propose (the reference for the reduced path)."""

    def __init__(self, drafter, target, d2t, use_relay):
        super().__init__(drafter, target, use_relay)
        self.outside = torch.ones(TINY_VOCAB, dtype=torch.bool)
        self.outside[d2t] = False

    def propose(self, anchor, position, size):
        return super().propose(anchor, position, size).masked_fill(self.outside, float("-inf"))


@pytest.mark.parametrize("relay", [True, False])
def test_reduced_drafter_decodes_losslessly_as_the_masked_full_one(relay):
    target = tiny_target("llama")
    with torch.no_grad():
        target.lm_head.weight[MAP[2:4]] *= 3  # favoured map ids: a random drafter is accepted now and then
    full = drafter_for(target).eval()
    small = reduced(full)
    prompt = [5, 17, 33, 8, 21, 9]
    ar = generate(target, prompt, proposer=None, block_size=1, max_new_tokens=40)
    ours = generate(target, prompt, proposer=DrafterProposer(small, target, use_relay=relay), block_size=B,
                    max_new_tokens=40)
    masked = generate(target, prompt, proposer=MaskedProposer(full, target, MAP, relay), block_size=B,
                      max_new_tokens=40)
    assert ours.token_ids == ar.token_ids == masked.token_ids
    assert [r.accepted for r in ours.rounds] == [r.accepted for r in masked.rounds]
    assert sum(r.accepted for r in ours.rounds) > 3  # drafts were accepted: the map's ids reached the target
    logits = DrafterProposer(small, target)
    logits.prefill(logits.fuse(torch.randn(1, 6, len(small.cfg.target_layer_ids) * 32)), 20)
    out = logits.propose(torch.tensor([5]), 6, B)  # [1, B-1, vocab]
    assert out.shape == (1, B - 1, TINY_VOCAB) and out.isfinite().sum() == (B - 1) * MAP.numel()


def test_vocab_coverage_counts_outputs_inside_the_map(tmp_path):
    """scripts/vocab_coverage.py: per dataset, the share of `ar`'s output tokens inside the map."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("vocab_coverage", Path(__file__).parents[1] / "scripts" / "vocab_coverage.py")
    cov = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cov)
    journal = tmp_path / "progress.jsonl"
    rows = [{"settings": {}},
            {"dataset": "a", "turns": {"ar": [{"token_ids": [1, 2, 3, 9]}], "pld": [{"token_ids": [9, 9]}]}},
            {"dataset": "a", "turns": {"ar": [{"token_ids": [2]}, {"token_ids": [7, 1]}]}},
            {"dataset": "b", "turns": {"ar": [{"token_ids": [9]}]}}]
    journal.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert cov.coverage({1, 2, 3}, str(journal)) == {"a": (5, 7), "b": (0, 1)}
    assert cov.coverage(None, str(journal)) == {"a": (7, 7), "b": (1, 1)}
    assert cov.coverage({9}, str(journal), "pld") == {"a": (2, 2)}
