"""Training indices without models: anchors, packed-block masks, labels, loss weights, transition."""

from __future__ import annotations

import math

import pytest
import torch

from dflow.train.batching import (additive_mask, anchor_candidates, block_chunks, block_labels, collate, loss_gamma,
                                  loss_weights, packed_block_mask, sample_anchors)
from dflow.train.dataset import prepare, prompt_of
from dflow.train.loop import learning_rate
from dflow.train.rollout import transition
from dflow.errors import DFlowError


def mask_of(bits: str) -> torch.Tensor:
    return torch.tensor([c == "1" for c in bits])


def test_loss_gamma_known_points_and_rule():
    assert (loss_gamma(16), loss_gamma(10), loss_gamma(8)) == (7.0, 5.0, 4.0)
    assert loss_gamma(2) == 1.0 and loss_gamma(12) == pytest.approx(5 + 2 / 3)
    assert loss_gamma(32) == pytest.approx(7 + 16 / 3)
    assert all(loss_gamma(b) < loss_gamma(b + 1) for b in range(2, 64))


def test_loss_weights():
    w = loss_weights(16)
    assert w.shape == (15,) and w[0] == 1.0
    assert torch.allclose(w, torch.tensor([math.exp(-(k - 1) / 7) for k in range(1, 16)]))
    assert loss_weights(2).tolist() == [1.0]


def test_anchor_candidates():
    #                      0123456789
    m = mask_of("0111011001")
    # s >= 1 with s and s+1 supervised: 1, 2, 5 (3: 4 unsupervised; 6: 7 unsupervised; 9: no s+1)
    assert anchor_candidates(m).nonzero().flatten().tolist() == [1, 2, 5]
    assert not anchor_candidates(mask_of("1100")).any()  # position 0 never anchors (no context)


def test_sample_anchors_rules():
    m = mask_of("0" * 5 + "1" * 40 + "0" * 3 + "1" * 10)
    allowed = set(anchor_candidates(m).nonzero().flatten().tolist())
    for seed in range(20):
        a = sample_anchors(m, 8, torch.Generator().manual_seed(seed))
        assert len(a) == 8 and len(set(a.tolist())) == 8 and a.tolist() == sorted(a.tolist())
        assert set(a.tolist()) <= allowed
    everything = sample_anchors(m, 1000, torch.Generator().manual_seed(0))
    assert set(everything.tolist()) == allowed  # up to N: all candidates when there are fewer
    again = sample_anchors(m, 8, torch.Generator().manual_seed(3))
    assert torch.equal(again, sample_anchors(m, 8, torch.Generator().manual_seed(3)))


def test_packed_block_mask_sees_context_before_anchor_and_own_block_only():
    T, B = 6, 3
    anchors = torch.tensor([[2, 4]])
    m = packed_block_mask(anchors, T, B, causal=False)
    assert m.shape == (1, 1, 2 * B, T + 2 * B)
    for q in range(2 * B):
        blk, s = q // B, anchors[0, q // B].item()
        ctx = m[0, 0, q, :T].tolist()
        assert ctx == [p < s for p in range(T)]  # strictly before the anchor
        own = m[0, 0, q, T:].tolist()
        assert own == [k // B == blk for k in range(2 * B)]
    c = packed_block_mask(anchors, T, B, causal=True)
    for q in range(2 * B):
        assert c[0, 0, q, T:].tolist() == [k // B == q // B and k <= q for k in range(2 * B)]
        assert torch.equal(c[0, 0, q, :T], m[0, 0, q, :T])
    add = additive_mask(m, torch.float32)
    assert (add[m] == 0).all() and (add[~m] == torch.finfo(torch.float32).min).all()


def test_block_chunks_runs_of_one_sequence_with_their_largest_anchor():
    rows, anchors = torch.tensor([0, 0, 0, 1, 1, 2]), torch.tensor([3, 5, 9, 7, 2, 4])
    assert block_chunks(rows, anchors, 2) == [(0, 0, 2, 5), (0, 2, 3, 9), (1, 3, 5, 7), (2, 5, 6, 4)]
    assert block_chunks(rows, anchors, 8) == [(0, 0, 3, 9), (1, 3, 5, 7), (2, 5, 6, 4)]
    assert block_chunks(rows[:0], anchors[:0], 2) == []


def test_chunked_attention_work_grows_linearly_with_anchors():
    """Query-key pairs of the chunked layout (context up to the chunk's largest anchor + the chunk's
    own keys) vs one dense mask over all blocks: 4x the anchors cost at most 4x, not 4x+."""
    T, B, per_chunk = 2048, 16, 8

    def pairs(n):
        anchors = torch.linspace(1, T - 2, n).long()
        chunked = sum((e - s) * B * (c + (e - s) * B) for _, s, e, c in block_chunks(torch.zeros(n), anchors, per_chunk))
        return chunked, n * B * (T + n * B)

    (small, dense_small), (large, dense_large) = pairs(128), pairs(512)
    assert large / small <= 4.05 and dense_large / dense_small > 6


def test_block_labels_same_position_and_masked():
    ids = torch.arange(10, 20)[None]  # y_p = 10 + p
    loss = mask_of("0111111100")[None]
    labels, valid = block_labels(ids, loss, torch.tensor([[1, 6]]), torch.tensor([[True, True]]), 4)
    assert labels.tolist() == [[[12, 13, 14], [17, 18, 19]]]  # index j of anchor s predicts y_{s+j}
    assert valid.tolist() == [[[True, True, True], [True, False, False]]]  # 8, 9 unsupervised
    _, past_end = block_labels(ids, loss, torch.tensor([[8]]), torch.tensor([[True]]), 4)
    assert not past_end.any()  # positions >= T and unsupervised ones carry no label
    _, dead = block_labels(ids, loss, torch.tensor([[1]]), torch.tensor([[False]]), 4)
    assert not dead.any()


def test_collate_pads_and_marks_live_anchors():
    seqs = [(torch.tensor([5, 6, 7]), mask_of("011")), (torch.tensor([8, 9]), mask_of("01"))]
    b = collate(seqs, [torch.tensor([1]), torch.tensor([], dtype=torch.long)])
    assert b.ids.tolist() == [[5, 6, 7], [8, 9, 0]] and b.lengths.tolist() == [3, 2]
    assert b.loss_mask.tolist() == [[False, True, True], [False, True, False]]
    assert b.anchors.tolist() == [[1], [0]] and b.live.tolist() == [[True], [False]]


def test_transition_hand_worked():
    """Trajectory y_p = 100 + p, positions 0..19, supervised 2..17; B = 5 (proposals d_1..d_4).

    anchor  proposals vs y_{s+1..s+4}   a   s' = s+a+1   b = y_{s'}   continues?
      3     104 105 0 0                 2   6            106          yes
      5     0 ...                       0   6            106          yes
      9     110 111 112 113             4   14           114          yes (14, 15 supervised)
     12     113 114 115 116             4   17           117          no (18 unsupervised)
     14     115 0 ...                   1   16           116          yes
    """
    T = 20
    ids = (100 + torch.arange(T))[None]
    loss = torch.zeros(1, T, dtype=torch.bool)
    loss[0, 2:18] = True
    b = collate([(ids[0], loss[0])], [torch.tensor([3, 5, 9, 12, 14])])
    d = torch.tensor([[[104, 105, 0, 0], [0, 107, 108, 109], [110, 111, 112, 113], [113, 114, 115, 116],
                       [115, 0, 117, 118]]])
    step = transition(d, b, b.anchors, b.live)
    assert step.accepted.tolist() == [[2, 0, 4, 4, 1]]
    assert step.live.tolist() == [[True, True, True, False, True]]
    assert step.anchors.tolist() == [[6, 6, 14, 0, 16]]  # a stopped anchor parks at 0
    assert step.bonus.tolist()[0][:3] == [106, 106, 114] and step.bonus[0, 4] == 116
    # a dead anchor stays dead, and a match past the sequence end does not count
    b2 = collate([(ids[0, :12], loss[0, :12])], [torch.tensor([9])])
    s2 = transition(torch.tensor([[[110, 111, 112, 113]]]), b2, b2.anchors, b2.live)
    assert s2.accepted.tolist() == [[2]] and s2.live.tolist() == [[False]]  # y_12 does not exist


def test_learning_rate_warmup_then_cosine():
    lrs = [learning_rate(s, 10, 1.0, 2) for s in range(10)]
    assert lrs[:2] == [0.5, 1.0] and lrs[2] == 1.0
    assert all(a > b for a, b in zip(lrs[2:], lrs[3:])) and lrs[-1] > 0
    assert learning_rate(10, 10, 1.0, 2) == pytest.approx(0.0)


def test_prepare_truncates_skips_and_counts():
    seqs = [
        (torch.arange(4, 24), mask_of("0" * 4 + "1" * 16)),  # 20 tokens: truncated to 12
        (torch.arange(4, 10), mask_of("000000")),  # no assistant tokens: skipped
        (torch.arange(4, 10), mask_of("000001")),  # one supervised token, no pair: skipped
        (torch.arange(4, 10), mask_of("000111")),
        (torch.arange(4, 10), mask_of("011110")),
    ]
    data = prepare(seqs, max_len=12, vocab_size=64, held_out=1)
    assert (data.truncated, data.skipped, len(data.train), len(data.held_out)) == (1, 2, 2, 1)
    assert len(data.train[0][0]) == 12
    assert prompt_of(data.held_out[0]) == [4]
    with pytest.raises(DFlowError, match="outside the target's vocabulary"):
        prepare(seqs, 12, vocab_size=10, held_out=0)
    with pytest.raises(DFlowError, match="3 usable sequences"):
        prepare(seqs, 12, 64, held_out=3)
