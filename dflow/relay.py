"""DFlow's relay: verifier states of a round's rejected suffix become the next block's inputs.

Index map (docs/DESIGN.md, "The relay"): with `a` drafts accepted in a block of size V, the
verifier state at old block index j = a+i (i = 1..V-1-a) lands at new block index i
(`relay_index_map`). Index a+1 is the state whose input was the first rejected draft d_{a+1};
it predicts position s+a+2, which is exactly what new index 1 (position s' + 1 = s+a+2) must
predict. Nothing is relayed when a = V-1.

Paper eq. 4-5, for each relayed index i:
    h_i            = hidden_norm(fc(verifier states at j))      (the drafter's own fusion)
    [beta; gamma]  = MLP([E(b); E(d_{a+1}); h_i])
    x_i            = E(mask) + beta * LayerNorm(h_i) + gamma
The MLP's last layer starts at zero, so an untrained relay is a no-op (x_i = E(mask)).
"""

from __future__ import annotations

import torch
from torch import nn

from dflow.errors import DFlowError


def require_relay(has_relay: bool, drafter: str = "this drafter") -> None:
    """The one check before method `dflow`: the drafter must carry relay weights."""
    if not has_relay:
        raise DFlowError(f"{drafter} has no relay (a DFlash checkpoint): use method dflash")


def relay_index_map(accepted: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The relay's index shift, the one definition the engine, the training rollout and the vLLM
    rows all use. accepted [n]: a of each of n verified blocks of `block` tokens ->
    old [n, block-1]: for new index i = 1..block-1, the old index a+i whose verifier state it takes
    (clamped to block-1 where nothing is relayed); relayed [n, block-1]: whether i is relayed at
    all (i <= block-1-a). `old[:, 0]` = a+1 is the index whose input was the first rejected draft
    d_{a+1}."""
    new = torch.arange(1, block, device=accepted.device)  # [block-1] new indices 1..block-1
    old = accepted[:, None] + new  # [n, block-1]
    return old.clamp(max=block - 1), old < block


class Relay(nn.Module):
    def __init__(self, hidden_size: int, mlp_hidden_size: int = 0):
        super().__init__()
        m = mlp_hidden_size or hidden_size
        self.norm = nn.LayerNorm(hidden_size)
        self.mlp = nn.Sequential(nn.Linear(3 * hidden_size, m), nn.SiLU(), nn.Linear(m, 2 * hidden_size))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.mlp[2].weight)
        nn.init.zeros_(self.mlp[2].bias)

    def forward(self, mask_embed, bonus_embed, rejected_embed, h):
        """mask_embed [hidden]; bonus_embed, rejected_embed [n, hidden] (E(b), E(d_{a+1}));
        h [n, r, hidden] projected verifier states -> block inputs x [n, r, hidden]."""
        r = h.shape[1]
        boundary = torch.cat([bonus_embed, rejected_embed], dim=-1)[:, None].expand(-1, r, -1)
        beta, gamma = self.mlp(torch.cat([boundary, h], dim=-1)).chunk(2, dim=-1)
        return mask_embed + beta * self.norm(h) + gamma
