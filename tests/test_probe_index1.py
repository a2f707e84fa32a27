"""scripts/probe_index1.py, the index-1 yardstick: its bigram table, its MLP probe, and that its
drafter accuracy counts the hits of the training rollout's round 0."""

from __future__ import annotations

import importlib.util
from argparse import Namespace
from pathlib import Path

import torch

from conftest import tiny_target
from dflow.pipeline import init_drafter
from dflow.train.batching import anchor_candidates, collate
from dflow.train.rollout import Rollout, TargetParts, context_forward

spec = importlib.util.spec_from_file_location("probe_index1", Path(__file__).parents[1] / "scripts" / "probe_index1.py")
probe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(probe)


def test_bigram_table_takes_the_most_frequent_successor():
    prev = torch.tensor([3, 3, 3, 5, 5, 7])
    nxt = torch.tensor([1, 2, 2, 4, 0, 2])
    table = probe.bigram_table(prev, nxt, 8)
    assert table[3] == 2 and table[7] == 2
    assert table[5] == 0  # a tie goes to the smaller id
    assert table[1] == 2  # never seen: the most frequent successor overall


def test_the_mlp_probe_learns_a_function_of_the_state():
    gen = torch.Generator().manual_seed(0)
    embed = torch.randn(16, 32, generator=gen).bfloat16()  # 16 ids, hidden 32
    state = torch.randn(4096, 32, generator=gen)
    label = state[:, :4].argmax(-1) * 4 + torch.arange(4096) % 4  # [4096] in 0..15
    token = torch.arange(4096) % 4  # the token gives the low bits, the state the high ones
    pairs = {"last": state, "token": token, "label": label}
    args = Namespace(seed=0, width=64, lr=3e-3, batch_size=128, eval_every=60_000, time_limit=None)
    result = probe.train_probe("last", pairs, pairs, embed, 1, 60_000, args)
    assert result["held_out_acc"] > 0.9 and result["pairs"] >= 60_000


def test_drafter_hits_are_the_training_rollouts_round_0_hits():
    target = tiny_target("llama")
    drafter = init_drafter(target, layers=2, block_size=4, relay=False)
    gen = torch.Generator().manual_seed(0)
    examples = []
    for t in (20, 27):
        ids = torch.randint(4, 64, (t,), generator=gen)
        mask = torch.zeros(t, dtype=torch.bool)
        mask[6:] = True
        examples.append((ids, mask))
    states = probe.States(target, drafter.cfg.target_layer_ids)
    correct, count = probe.drafter_hits(drafter, target, examples, [0, 1], states, chunk=5)
    rollout = Rollout(drafter, TargetParts(target, drafter.cfg.target_layer_ids), rounds=0, use_relay=False)
    want = torch.zeros(2)
    for ids, mask in examples:
        batch = collate([(ids, mask)], [anchor_candidates(mask).nonzero().flatten()])
        features, _ = context_forward(target, batch.ids, drafter.cfg.target_layer_ids, keep_cache=False)
        _, stats = rollout(batch, features, None)
        want += stats[0, 2:4]  # correct, labels
    assert torch.equal(torch.stack([correct.sum(), count.sum()]), want)
    assert count[0] == sum(int(anchor_candidates(m).sum()) for _, m in examples)  # index 1: every anchor
