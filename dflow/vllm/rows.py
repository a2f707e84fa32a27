"""Which verifier rows the relay moves where, in vLLM's flattened batch layout (no vLLM import).

vLLM hands the DFlash proposer the verifier states of *every* scheduled token of a step, the
rejected drafts included, as one flat tensor: request i owns rows [query_start[i], query_start[i+1]),
and its last `num_rejected[i]` rows are the rejected suffix (old block indices a+1..B-1, DESIGN.md
step 5). The next block of request i is query rows i*B .. i*B+B-1 (bonus, then B-1 masks).
Old index a+k (row query_start[i+1] - num_rejected[i] + k - 1) -> new index k, k = 1..num_rejected[i],
exactly `dflow.relay.relay_source_indices`. A request whose count exceeds B-1 (vLLM's discarded
requests) relays nothing.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class RelayRows(NamedTuple):
    src: torch.Tensor  # [n] rows of the verifier states to relay
    dst: torch.Tensor  # [n] rows of the next blocks' query inputs they replace
    first_rejected: torch.Tensor  # [n] row of the first rejected draft d_{a+1} of the same request
    request: torch.Tensor  # [n] request index of each relayed row (selects the bonus b)


def relay_rows(query_start: torch.Tensor, num_rejected: torch.Tensor, block: int) -> RelayRows:
    """query_start [batch+1] (row offsets of each request's verified tokens), num_rejected [batch],
    block = B = 1 + num_speculative_tokens -> the relayed rows of the whole batch, request-major."""
    query_start = query_start.long()
    r = num_rejected.long()  # [batch]
    r = torch.where((r >= 1) & (r <= block - 1), r, torch.zeros_like(r))
    request = torch.repeat_interleave(torch.arange(r.numel(), device=r.device), r)  # [n]
    k = torch.arange(request.numel(), device=r.device) - (torch.cumsum(r, 0) - r)[request] + 1  # [n] new index 1..r_i
    first_rejected = query_start[1:][request] - r[request]  # [n]
    return RelayRows(src=first_rejected + k - 1, dst=request * block + k, first_rejected=first_rejected,
                     request=request)
