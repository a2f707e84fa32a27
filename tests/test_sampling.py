"""Speculative sampling rules on hand-made distributions: no model, explicit generators."""

import pytest
import torch
from stats import chi_square_pvalue

from dflow.sampling import (
    accept,
    draft_tokens,
    greedy_accept,
    greedy_ids,
    match_accept,
    rejection_accept,
    sample,
    sampling_probs,
    validate_sampling,
)

N = 40_000  # vectorised draws for the distribution checks


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rows(probs: list[float], batch: int, K: int) -> torch.Tensor:  # [batch, K, vocab]
    return torch.tensor(probs).expand(batch, K, -1)


def emitted_first(draft_ids: torch.Tensor, accepted: torch.Tensor, next_token: torch.Tensor):
    """The first token a round commits after the anchor: d_1 if accepted, else the next token."""
    return torch.where(accepted > 0, draft_ids[:, 0], next_token)


@pytest.mark.parametrize(
    "temperature, top_k, top_p, message",
    [(-0.1, 0, 1.0, "temperature"), (1.0, -1, 1.0, "top_k"), (1.0, 2.5, 1.0, "top_k"),
     (1.0, 0, 0.0, "top_p"), (1.0, 0, 1.5, "top_p"), (float("nan"), 0, 1.0, "temperature")],
)
def test_validate_sampling_rejects_bad_args(temperature, top_k, top_p, message):
    with pytest.raises(ValueError, match=message):
        validate_sampling(temperature, top_k, top_p)


def test_sampling_probs_needs_positive_temperature():
    with pytest.raises(ValueError, match="temperature > 0"):
        sampling_probs(torch.zeros(3), 0.0)


def test_temperature_scales_logits():
    logits = torch.tensor([0.0, 2.0, 4.0])
    torch.testing.assert_close(sampling_probs(logits, 2.0), torch.softmax(logits / 2, -1))


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0], [4.0, 3.0, 3.0, 0.0]])  # row 2: a tie at k
    probs = sampling_probs(logits, 1.0, top_k=2)
    expected = torch.softmax(torch.tensor([[-torch.inf, 4.0, 3.0, -torch.inf],
                                           [4.0, 3.0, 3.0, -torch.inf]]), -1)
    torch.testing.assert_close(probs, expected)


def test_top_p_keeps_smallest_prefix_reaching_mass():
    probs = torch.tensor([0.1, 0.45, 0.3, 0.15])
    logits = probs.log()
    # Sorted: 0.45, 0.3, 0.15, 0.1. top_p = 0.7 needs 0.45 + 0.3; 0.4 needs 0.45 alone.
    torch.testing.assert_close(sampling_probs(logits, 1.0, top_p=0.7),
                               torch.tensor([0.0, 0.6, 0.4, 0.0]))
    torch.testing.assert_close(sampling_probs(logits, 1.0, top_p=0.4),
                               torch.tensor([0.0, 1.0, 0.0, 0.0]))
    torch.testing.assert_close(sampling_probs(logits, 1.0, top_p=0.76),
                               torch.tensor([0.0, 0.5, 1 / 3, 0.5 / 3]))


def test_top_k_then_top_p():
    logits = torch.tensor([0.1, 0.45, 0.3, 0.15]).log()
    # top-k 3 leaves 0.45, 0.3, 0.15 (renormalised 0.5, 1/3, 1/6); top-p 0.8 then keeps two.
    torch.testing.assert_close(sampling_probs(logits, 1.0, top_k=3, top_p=0.8),
                               torch.tensor([0.0, 0.6, 0.4, 0.0]))


def test_sample_keeps_leading_shape_and_skips_zero_mass():
    probs = torch.tensor([0.0, 0.5, 0.5, 0.0]).expand(3, 5, 4)
    ids = sample(probs, gen())
    assert ids.shape == (3, 5) and ids.dtype == torch.long
    assert set(ids.unique().tolist()) <= {1, 2}


def test_greedy_accept_hand_case():
    target_argmax = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [0, 0, 0, 0]])
    target_logits = torch.eye(5)[target_argmax]  # [3, K+1=4, 5]
    draft_ids = torch.tensor([[1, 2, 3], [1, 0, 3], [1, 2, 3]])
    accepted, next_token = greedy_accept(draft_ids, target_logits)
    assert accepted.tolist() == [3, 1, 0]
    assert next_token.tolist() == [4, 2, 0]  # bonus, then the target's token at the miss


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_greedy_ids_picks_what_argmax_picks(dtype):
    """Ties (first maximum wins), NaN (it wins) and -inf rows of a reduced vocabulary alike."""
    g = gen(3)
    logits = torch.randint(0, 3, (4, 9, 4099), generator=g).to(dtype)  # many ties
    logits[1, :, 2048:] = float("-inf")
    logits[2, 3, 77] = float("nan")
    logits[3] = float("-inf")
    logits[3, :, 5] = 0.0
    assert torch.equal(greedy_ids(logits), logits.argmax(dim=-1))
    assert greedy_ids(logits)[2, 3] == 77 and (greedy_ids(logits)[3] == 5).all()


def test_match_accept_hand_case():
    # One-hot target probs, so the target's samples are known.
    target_probs = torch.eye(5)[torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4]])]  # [2, K+1=4, 5]
    accepted, next_token = match_accept(torch.tensor([[1, 2, 3], [1, 0, 3]]), target_probs, gen())
    assert accepted.tolist() == [3, 1]
    assert next_token.tolist() == [4, 2]


def test_rejection_p_equals_q_accepts_everything():
    p = [0.1, 0.2, 0.3, 0.4]
    q = rows(p, 1000, 3)
    draft_ids = sample(q, gen(1))
    accepted, next_token = rejection_accept(draft_ids, q, rows(p, 1000, 4), gen(2))
    assert (accepted == 3).all()
    assert next_token.bincount(minlength=4)[0] > 50  # the bonus is drawn from p_K


def test_rejection_disjoint_rejects_first_and_draws_from_p():
    p, q = [0.0, 0.0, 0.25, 0.75], [0.5, 0.5, 0.0, 0.0]
    draft_ids = sample(rows(q, N, 2), gen(1))
    accepted, next_token = rejection_accept(draft_ids, rows(q, N, 2), rows(p, N, 3), gen(2))
    assert (accepted == 0).all()
    assert chi_square_pvalue(next_token.bincount(minlength=4), torch.tensor(p)) > 0.01


def test_rejection_residual_distribution():
    p, q = [0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1]
    residual = torch.tensor([0.0, 0.0, 0.25, 0.75])  # norm(max(0, p - q)) by hand
    draft_ids = torch.zeros(N, 1, dtype=torch.long)  # d_1 = 0: accepted with p/q = 0.25
    accepted, next_token = rejection_accept(draft_ids, rows(q, N, 1), rows(p, N, 2), gen(3))
    assert abs(accepted.float().mean().item() - 0.25) < 0.02
    recovered = next_token[accepted == 0]
    freq = recovered.bincount(minlength=4).float() / len(recovered)
    torch.testing.assert_close(freq, residual, atol=0.02, rtol=0)
    assert chi_square_pvalue(recovered.bincount(minlength=4), residual) > 0.01


def test_rejection_zero_residual_falls_back_to_p():
    # q >= p everywhere (rounding exaggerated): rejections leave no residual mass.
    p, q = [0.5, 0.5, 0.0], [1.0, 0.5, 0.0]
    draft_ids = torch.zeros(N, 1, dtype=torch.long)  # accepted with p/q = 0.5
    accepted, next_token = rejection_accept(draft_ids, rows(q, N, 1), rows(p, N, 2), gen(4))
    recovered = next_token[accepted == 0]
    assert 0.4 < len(recovered) / N < 0.6
    assert chi_square_pvalue(recovered.bincount(minlength=3), torch.tensor(p)) > 0.01


def test_zero_draft_tokens():
    p0 = torch.eye(4)[[2, 3]][:, None]  # [2, K+1=1, 4]
    empty_ids, empty_q = torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, 0, 4)
    for accepted, next_token in [rejection_accept(empty_ids, empty_q, p0, gen()),
                                 match_accept(empty_ids, p0, gen()),
                                 greedy_accept(empty_ids, p0)]:
        assert accepted.tolist() == [0, 0] and next_token.tolist() == [2, 3]


def test_same_seed_same_output():
    torch.manual_seed(0)
    draft_logits, target_logits = torch.randn(64, 4, 10), torch.randn(64, 5, 10)

    def run(seed: int, rule: str):
        g = gen(seed)
        ids, q = draft_tokens(draft_logits, 0.8, 5, 0.9, g)
        return ids, accept(ids, q, target_logits, 0.8, 5, 0.9, g, rule=rule)

    for rule in ("rejection", "match"):
        ids, (accepted, next_token) = run(7, rule)
        ids2, (accepted2, next_token2) = run(7, rule)
        assert torch.equal(ids, ids2) and torch.equal(accepted, accepted2)
        assert torch.equal(next_token, next_token2)
        assert not torch.equal(ids, run(8, rule)[0])


@pytest.mark.parametrize("rule", ["rejection", "match"])
def test_temperature_zero_is_greedy_exactly(rule):
    torch.manual_seed(0)
    draft_logits, target_logits = torch.randn(16, 4, 10), torch.randn(16, 5, 10)
    target_logits[:8, :4] = draft_logits[:8] * 3  # some rows agree, so accepted varies
    g = gen()
    state = g.get_state()
    ids, q = draft_tokens(draft_logits, 0.0, 5, 0.9, g)
    assert q is None and torch.equal(ids, draft_logits.argmax(-1))
    result = accept(ids, q, target_logits, 0.0, 5, 0.9, g, rule=rule)
    expected = greedy_accept(ids, target_logits)
    assert torch.equal(result[0], expected[0]) and torch.equal(result[1], expected[1])
    assert result[0][:8].eq(4).all()
    assert torch.equal(g.get_state(), state)  # no random draw was made


def test_accept_argument_errors():
    ids, logits = torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 3, 4)
    with pytest.raises(ValueError, match="rule"):
        accept(ids, None, logits, 1.0, 0, 1.0, gen(), rule="typical")
    with pytest.raises(ValueError, match="draft probs"):
        accept(ids, None, logits, 1.0, 0, 1.0, gen(), rule="rejection")


P = [0.05, 0.1, 0.15, 0.3, 0.4, 0.0]
BAD_Q = [0.3, 0.25, 0.2, 0.1, 0.05, 0.1]  # the wrong shape, and mass where p has none


@pytest.mark.parametrize("rule", ["rejection", "match"])
def test_first_emitted_token_follows_target(rule):
    draft_ids = sample(rows(BAD_Q, N, 1), gen(11))
    if rule == "rejection":
        q, p = rows(BAD_Q, N, 1), rows(P, N, 2)
        accepted, next_token = rejection_accept(draft_ids, q, p, gen(12))
    else:
        accepted, next_token = match_accept(draft_ids, rows(P, N, 2), gen(12))
    first = emitted_first(draft_ids, accepted, next_token)
    assert chi_square_pvalue(first.bincount(minlength=6), torch.tensor(P)) > 0.01


def test_chi_square_detects_always_accept():
    draft_ids = sample(rows(BAD_Q, N, 1), gen(11))
    always = torch.ones(N, dtype=torch.long)  # a broken rule: accept every draft
    first = emitted_first(draft_ids, always, torch.zeros(N, dtype=torch.long))
    assert chi_square_pvalue(first.bincount(minlength=6), torch.tensor(P)) < 0.01
    # Even with q's extra token removed, the wrong shape alone is caught.
    kept = first[first != 5]
    assert chi_square_pvalue(kept.bincount(minlength=6), torch.tensor(P)) < 0.01


def test_chi_square_pvalue_known_values():
    # df = 1, stat = 3.841 is the 5% point; df = 2 has the closed form exp(-stat / 2).
    pvalue = chi_square_pvalue(torch.tensor([59.8, 40.2]), torch.tensor([0.5, 0.5]))
    assert pvalue == pytest.approx(0.05, abs=2e-3)
    counts, probs = torch.tensor([30.0, 40.0, 30.0]), torch.tensor([0.3, 0.3, 0.4])
    stat = 0 + 10**2 / 30 + 10**2 / 40
    assert chi_square_pvalue(counts, probs) == pytest.approx(torch.tensor(-stat / 2).exp().item())
