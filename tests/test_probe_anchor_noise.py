"""scripts/probe_anchor_noise.py: its covariance-trace estimate, and one probe on a tiny target."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from conftest import tiny_target, training_examples
from dflow.pipeline import init_drafter

spec = importlib.util.spec_from_file_location("probe_anchor_noise",
                                              Path(__file__).parents[1] / "scripts" / "probe_anchor_noise.py")
probe = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = probe  # its dataclass looks its module up
spec.loader.exec_module(probe)


def test_moments_estimate_the_trace_of_the_covariance():
    gen = torch.Generator().manual_seed(0)
    mu = torch.randn(2000, generator=gen)
    m = probe.Moments()
    for _ in range(40):
        m.add(mu + 0.5 * torch.randn(2000, generator=gen))
    assert m.noise() == pytest.approx(2000 * 0.25, rel=0.05)  # d sigma^2, the mean's own norm left out
    assert float((m.mean - mu).square().sum()) == pytest.approx(2000 * 0.25 / 40, rel=0.2)
    same = probe.Moments()
    for _ in range(3):
        same.add(mu)
    assert abs(same.noise()) < 1e-6 * float(mu.square().sum())


def test_more_anchors_a_sequence_draw_more_blocks_with_less_noise():
    torch.manual_seed(0)
    target = tiny_target("llama")
    drafter = init_drafter(target, layers=2, block_size=4, relay=False).train()
    data = training_examples()
    rows = probe.probe(target, drafter, data, [2, 16], micro=8, batch_size=1, seed=0)
    few, many = rows[2], rows[16]
    assert few["blocks_per_micro"] == 2 and many["blocks_per_micro"] == 16
    assert few["context_s"] == many["context_s"] > 0 and many["drafter_s"] > 0
    assert 0 < many["noise"] < few["noise"]
    assert few["noise_x_cost"] == pytest.approx(few["noise"] * few["cost_s"])
