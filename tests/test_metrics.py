"""Metric definitions against hand-computed examples (docs/DESIGN.md, "Metrics")."""

import math
from types import SimpleNamespace

import pytest

from dflow import metrics


def rnd(accepted, drafted=3, committed=None, draft=0.001, relay=0.0, verify=0.004, bookkeeping=0.0005):
    """A round dict; committed defaults to a+1 (no stop token, no max_new_tokens cut)."""
    return {
        "accepted": accepted,
        "committed": accepted + 1 if committed is None else committed,
        "drafted": drafted,
        "draft_s": draft,
        "relay_s": relay,
        "verify_s": verify,
        "bookkeeping_s": bookkeeping,
    }


# Block size 4 (3 draft positions). Sample A: a = 3, 1; sample B: a = 0, 2, 0, 1 (last round cut
# by max_new_tokens: 1 accepted but only 1 committed, and only 2 positions drafted).
SAMPLE_A = [rnd(3), rnd(1)]
SAMPLE_B = [rnd(0), rnd(2), rnd(0), rnd(1, drafted=2, committed=1)]
SAMPLES = [SAMPLE_A, SAMPLE_B]


def test_tau_global_with_and_without_bonus():
    # committed: 4 + 2 + 1 + 3 + 1 + 1 = 12 over 6 rounds
    assert metrics.tau(SAMPLES) == pytest.approx(12 / 6)
    # accepted: 3 + 1 + 0 + 2 + 0 + 1 = 7 over 6 rounds
    assert metrics.mean_accepted(SAMPLES) == pytest.approx(7 / 6)


def test_tau_per_sample_differs_from_global_on_uneven_samples():
    # A: 6/2 = 3; B: 6/4 = 1.5; mean 2.25 != global 2.0
    assert metrics.tau_per_sample(SAMPLES) == pytest.approx(2.25)
    assert metrics.tau_per_sample(SAMPLES + [[]]) == pytest.approx(2.25)  # no rounds: left out


def test_acceptance_by_position_with_partial_last_block():
    # j=1: a>=1 in 4 rounds / drafted>=1 in 6; j=2: 2/6; j=3: 1 / drafted>=3 in 5
    assert metrics.acceptance_by_position(SAMPLES, block_size=4) == pytest.approx([4 / 6, 2 / 6, 1 / 5])


def test_accepted_histogram():
    assert metrics.accepted_histogram(SAMPLES, block_size=4) == [2, 2, 1, 1]
    with pytest.raises(ValueError):
        metrics.accepted_histogram([[rnd(4)]], block_size=4)


def test_objects_and_dicts_are_equivalent():
    as_objects = [[SimpleNamespace(**r) for r in sample] for sample in SAMPLES]
    assert metrics.summarize_rounds(as_objects, 4) == metrics.summarize_rounds(SAMPLES, 4)


def test_time_split_means_ms_per_round():
    split = metrics.time_split([[rnd(0, relay=0.0), rnd(0, relay=0.002)]])
    expected = {"draft": 1.0, "relay": 1.0, "verify": 4.0, "bookkeeping": 0.5, "total": 6.5}
    assert split == pytest.approx(expected)


def test_autoregressive_rounds():
    ar = [[rnd(0, drafted=0) for _ in range(5)]]
    assert metrics.tau(ar) == 1.0 and metrics.mean_accepted(ar) == 0.0
    assert all(math.isnan(p) for p in metrics.acceptance_by_position(ar, 4))
    assert metrics.accepted_histogram(ar, 4) == [5, 0, 0, 0]


def test_speedup_and_throughput():
    assert metrics.speedup(10.0, 4.0) == 2.5
    assert metrics.tokens_per_s(100, 4.0) == 25.0
    assert math.isnan(metrics.speedup(10.0, 0.0)) and math.isnan(metrics.tokens_per_s(5, 0.0))


@pytest.mark.parametrize("empty", [[], [[]]])
def test_empty_inputs_give_nan_means_and_zero_counts(empty):
    assert math.isnan(metrics.tau(empty))
    assert math.isnan(metrics.tau_per_sample(empty))
    assert math.isnan(metrics.mean_accepted(empty))
    assert all(math.isnan(p) for p in metrics.acceptance_by_position(empty, 4))
    assert metrics.accepted_histogram(empty, 4) == [0, 0, 0, 0]
    assert all(math.isnan(v) for v in metrics.time_split(empty).values())
    assert metrics.summarize_rounds(empty, 4)["num_rounds"] == 0


def test_paired_differences():
    p = metrics.paired([3.0, 2.0, 5.0, 1.0], [1.0, 2.0, 2.0, 2.0])  # differences 2, 0, 3, -1
    assert (p.n, p.wins, p.losses) == (4, 2, 1) and p.mean == pytest.approx(1.0)
    assert p.se == pytest.approx(math.sqrt(((1 + 1 + 4 + 4) / 3) / 4))
    assert math.isnan(metrics.paired([1.0], [0.0]).se)
    with pytest.raises(ValueError, match="equal lengths"):
        metrics.paired([1.0], [])
