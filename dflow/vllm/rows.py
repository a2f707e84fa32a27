"""Which verifier rows the relay moves where, in vLLM's flattened batch layout (no vLLM import).

vLLM hands the DFlash proposer the verifier states of *every* scheduled token of a step, the
rejected drafts included, as one flat tensor: request i owns rows [query_start[i], query_start[i+1]),
and its last `num_rejected[i]` rows are the rejected suffix (old block indices a+1..B-1,
docs/DESIGN.md, "The relay"). The next block of request i is query rows i*B .. i*B+B-1 (bonus,
then B-1 masks). A request's verified block is its last B rows, so with a = B-1-num_rejected[i],
old index a+k (row query_start[i+1] - B + a + k) -> new index k, k = 1..num_rejected[i]: exactly
`dflow.relay.relay_index_map`. A request whose count exceeds B-1 (vLLM's discarded requests)
relays nothing.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dflow.relay import relay_index_map


class RelayRows(NamedTuple):
    src: torch.Tensor  # [n] rows of the verifier states to relay
    dst: torch.Tensor  # [n] rows of the next blocks' query inputs they replace
    first_rejected: torch.Tensor  # [n] row of the first rejected draft d_{a+1} of the same request
    request: torch.Tensor  # [n] request index of each relayed row (selects the bonus b)


def relay_rows(query_start: torch.Tensor, num_rejected: torch.Tensor, block: int) -> RelayRows:
    """query_start [batch+1] (row offsets of each request's verified tokens), num_rejected [batch],
    block = B = 1 + num_speculative_tokens -> the relayed rows of the whole batch, request-major."""
    r = num_rejected.long()  # [batch]
    r = torch.where((r >= 1) & (r <= block - 1), r, torch.zeros_like(r))  # 0: nothing relayed
    old, relayed = relay_index_map(block - 1 - r, block)  # [batch, B-1] each; a = B-1: nothing relayed
    block_start = query_start[1:].long()[:, None] - block  # [batch, 1] row of each block's index 0
    new = torch.arange(1, block, device=r.device)  # [B-1]
    request = torch.arange(r.numel(), device=r.device)[:, None].expand_as(old)  # [batch, B-1]
    first_rejected = (block_start + old[:, :1]).expand_as(old)  # [batch, B-1] row of old index a+1
    return RelayRows(src=(block_start + old)[relayed], dst=(request * block + new)[relayed],
                     first_rejected=first_rejected[relayed], request=request[relayed])
