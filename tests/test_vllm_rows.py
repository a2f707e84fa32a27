"""The relay index map, and its rows in vLLM's flat batch layout, follow docs/DESIGN.md's shift (no vLLM)."""

from __future__ import annotations

import torch

from dflow.relay import relay_index_map
from dflow.vllm.rows import relay_rows


def test_rows_follow_the_design_shift_per_request():
    B = 8
    lengths = [B, B, 3, B, B]  # verified tokens per request (3: a prefill chunk, no drafts)
    rejected = [0, 7, 0, 3, 8]  # a = 7, 0, -, 4; 8 > B-1: a discarded request, nothing relayed
    starts = torch.tensor([0] + lengths).cumsum(0)
    rows = relay_rows(starts, torch.tensor(rejected), B)
    expect_src, expect_dst, expect_first = [], [], []
    for i, (n, r) in enumerate(zip(lengths, rejected)):
        if not 1 <= r <= B - 1:
            continue
        a = n - 1 - r
        for j in range(a + 1, n):  # old block index j -> new index j - a
            expect_src.append(int(starts[i]) + j)
            expect_dst.append(i * B + j - a)
            expect_first.append(int(starts[i]) + a + 1)
    assert rows.src.tolist() == expect_src
    assert rows.dst.tolist() == expect_dst
    assert rows.first_rejected.tolist() == expect_first
    assert rows.request.tolist() == [1] * 7 + [3] * 3


def test_no_rejections_no_rows():
    rows = relay_rows(torch.tensor([0, 8, 16]), torch.tensor([0, 0]), 8)
    assert rows.src.numel() == rows.dst.numel() == 0


def test_relay_index_map_hand_case():
    """a = 0, 2, 3 in blocks of 4: new index i takes old index a+i while a+i <= 3."""
    old, relayed = relay_index_map(torch.tensor([0, 2, 3]), 4)
    assert old.tolist() == [[1, 2, 3], [3, 3, 3], [3, 3, 3]]
    assert relayed.tolist() == [[True, True, True], [True, False, False], [False, False, False]]
