"""DFlow's relay: verifier states of a round's rejected suffix become the next block's inputs.

Index map (DESIGN.md): with `a` drafts accepted in a block of size V, the verifier state at old
block index j = a+i (i = 1..V-1-a) lands at new block index i. Index a+1 is the state whose
input was the first rejected draft d_{a+1}; it predicts position s+a+2, which is exactly what
new index 1 (position s' + 1 = s+a+2) must predict. Nothing is relayed when a = V-1.

Paper eq. 4-5, for each relayed index i:
    h_i            = hidden_norm(fc(verifier states at j))      (the drafter's own fusion)
    [beta; gamma]  = MLP([E(b); E(d_{a+1}); h_i])
    x_i            = E(mask) + beta * LayerNorm(h_i) + gamma
The MLP's last layer starts at zero, so an untrained relay is a no-op (x_i = E(mask)).
"""

from __future__ import annotations

import torch
from torch import nn


def relay_source_indices(accepted: int, block: int) -> range:
    """Old block indices whose verifier states are relayed (new index = old - accepted)."""
    return range(accepted + 1, block)


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
