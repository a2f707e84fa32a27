"""Proposers: what supplies a round's drafts to the engine.

`DrafterProposer` runs the DFlash drafter, with DFlow's relay when asked; `OracleProposer`
proposes a known continuation (tests and the speed ceiling benchmark).
"""

from __future__ import annotations

import torch

from dflow.drafter import ContextCache, apply_head
from dflow.model import DFlowDrafter


class DrafterProposer:
    """DFlash drafting over a context K/V cache; with `use_relay`, DFlow's relay on top."""

    def __init__(self, drafter: DFlowDrafter, target, use_relay: bool = True):
        if use_relay and drafter.relay is None:
            raise ValueError("this drafter has no relay weights; use method dflash")
        self.model = drafter.dflash
        self.relay_module = drafter.relay if use_relay else None
        self.layer_ids = tuple(drafter.cfg.target_layer_ids)
        self.embed = target.get_input_embeddings()
        self.head = target.get_output_embeddings()
        self.mask_id = drafter.cfg.mask_token_id
        self.cache = ContextCache(len(self.model.layers))
        self.relayed: torch.Tensor | None = None  # [1, r, hidden] inputs for new indices 1..r

    def start(self, features: torch.Tensor) -> None:
        self.cache = ContextCache(len(self.model.layers))
        self.relayed = None
        self.commit(features, 0)

    def commit(self, features: torch.Tensor, start: int) -> None:
        """Committed target features [1, t, F] at positions start..start+t-1 enter the context."""
        ctx = self.model.project(features)  # [1, t, hidden]
        positions = torch.arange(start, start + ctx.shape[1])[None]
        self.cache.append(self.model.context_kv(ctx, positions))
        self.relayed = None

    def propose(self, anchor: torch.Tensor, start: int, size: int) -> torch.Tensor:
        """anchor [1] at position `start` -> draft logits [1, size-1, vocab]."""
        ids = torch.full((1, size), self.mask_id, dtype=torch.long)
        ids[0, 0] = anchor[0]
        x = self.embed(ids)  # [1, size, hidden]
        if self.relayed is not None:
            r = min(self.relayed.shape[1], size - 1)
            x = torch.cat([x[:, :1], self.relayed[:, :r].to(x.dtype), x[:, 1 + r:]], dim=1)
        positions = torch.arange(start, start + size)[None]
        hidden = self.model(x, positions, self.cache.layers())  # [1, size, hidden]
        return apply_head(self.head, hidden[:, 1:])

    def relay(self, features: torch.Tensor, bonus: torch.Tensor, rejected: torch.Tensor) -> None:
        """features [1, r, F]: verifier states at old indices a+1..V-1 -> next block's 1..r.
        bonus [1] = b, rejected [1] = d_{a+1}: the two boundary tokens."""
        if self.relay_module is None:
            return
        h = self.model.project(features)  # [1, r, hidden]
        emb = self.embed.weight
        self.relayed = self.relay_module(emb[self.mask_id], emb[bonus], emb[rejected], h)


class OracleProposer:
    """Proposes a known continuation: `sequence` holds prompt + expected output ids."""

    layer_ids: tuple[int, ...] = ()

    def __init__(self, sequence: list[int], vocab_size: int):
        self.sequence = list(sequence)
        self.vocab_size = vocab_size

    def start(self, features) -> None:
        pass

    def commit(self, features, start: int) -> None:
        pass

    def relay(self, features, bonus, rejected) -> None:
        pass

    def propose(self, anchor: torch.Tensor, start: int, size: int) -> torch.Tensor:
        ids = self.sequence[start + 1: start + size]
        ids = ids + [0] * (size - 1 - len(ids))
        logits = torch.full((1, size - 1, self.vocab_size), -1e4)
        logits[0, torch.arange(size - 1), torch.tensor(ids)] = 1e4
        return logits
