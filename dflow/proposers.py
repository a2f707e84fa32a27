"""Proposers: what supplies a round's drafts to the engine (the `Proposer` protocol of engine.py).

`DrafterProposer` runs the DFlash drafter, with DFlow's relay when asked; `OracleProposer`
proposes a known continuation (tests and the speed ceiling benchmark). `proposer_for` maps a
decoding method to its proposer: the one place that knows `METHODS`.
"""

from __future__ import annotations

import torch

from dflow.drafter import ContextCache
from dflow.errors import DFlowError
from dflow.model import DFlowDrafter
from dflow.relay import relay_index_map, require_relay
from dflow.vocab import apply_head, draft_head, to_target_logits

METHODS = ("ar", "dflash", "dflow")  # the target alone; the drafter; the drafter + relay


class DrafterProposer:
    """DFlash drafting over a context K/V cache; with `use_relay`, DFlow's relay on top.
    Everything it makes lives on the target's device."""

    def __init__(self, drafter: DFlowDrafter, target, use_relay: bool = True):
        if use_relay:
            require_relay(drafter.relay is not None)
        self.model = drafter.dflash
        self.relay_module = drafter.relay if use_relay else None  # the drafter's Relay, or None: plain masks
        self.layer_ids = tuple(drafter.cfg.target_layer_ids)
        self.embed = target.get_input_embeddings()
        self.d2t = drafter.dflash.d2t  # [N] or None: a reduced draft vocabulary (dflow.vocab)
        self.head = draft_head(target.get_output_embeddings(), self.d2t)  # [N or vocab] rows of the target's head
        self.vocab_size = drafter.cfg.vocab_size
        self.mask_id = drafter.cfg.mask_token_id
        self.cache = ContextCache(0)
        self.relayed: torch.Tensor | None = None  # [1, r, hidden] the next block's inputs at indices 1..r

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Raw target features [1, t, F] -> the drafter's fused context H [1, t, hidden] (`project`)."""
        return self.model.project(features)

    def prefill(self, context: torch.Tensor, capacity: int) -> None:
        """The prompt's context [1, n, hidden] (positions 0..n-1) starts a fresh cache of `capacity` positions."""
        self.cache = ContextCache(capacity)
        self.relayed = None
        self.commit(context, 0)

    def commit(self, context: torch.Tensor, position: int) -> None:
        """Committed context [1, t, hidden] at positions position..position+t-1 enters the cache."""
        positions = torch.arange(position, position + context.shape[1], device=self.device)[None]
        self.cache.write(self.model.context_kv(context, positions), position)

    def propose(self, anchor: torch.Tensor, position: int, size: int) -> torch.Tensor:
        """anchor [1] at `position` -> draft logits [1, size-1, vocab] over the target's vocabulary
        (-inf outside a reduced draft vocabulary). Block inputs: E(anchor), then the relayed inputs
        of the last `relay_rejected` (once), else E(mask)."""
        first = self.embed(anchor)[:, None]  # [1, 1, hidden]
        if self.relayed is not None:
            rest = self.relayed[:, : size - 1].to(first.dtype)
        else:
            rest = self.embed.weight[self.mask_id].expand(1, size - 1, -1)
        self.relayed = None
        x = torch.cat([first, rest], dim=1)  # [1, size, hidden]
        positions = torch.arange(position, position + size, device=self.device)[None]
        hidden = self.model(x, positions, self.cache.layers())  # [1, size, hidden]
        return to_target_logits(apply_head(self.head, hidden[:, 1:]), self.d2t, self.vocab_size)

    def relay_rejected(self, context: torch.Tensor, tokens: torch.Tensor, accepted: torch.Tensor,
                       bonus: torch.Tensor) -> None:
        """The verified block (context [1, V, hidden] from `fuse`, tokens [1, V] = [anchor,
        d_1..d_{V-1}], accepted [1], bonus [1]) -> the next block's inputs at indices 1..V-1: the
        verifier state of old index a+i through the relay at new index i, E(mask) past the
        rejected suffix."""
        if self.relay_module is None:
            return
        old, relayed = relay_index_map(accepted, tokens.shape[1])  # [1, V-1] each
        h = context.gather(1, old[..., None].expand(-1, -1, context.shape[-1]))  # [1, V-1, hidden]
        emb = self.embed.weight
        rejected = tokens.gather(1, old[:, :1])[:, 0]  # [1] d_{a+1}
        x = self.relay_module(emb[self.mask_id], emb[bonus], emb[rejected], h)  # [1, V-1, hidden]
        self.relayed = torch.where(relayed[..., None], x, emb[self.mask_id].to(x.dtype))


class OracleProposer:
    """Proposes a known continuation: `sequence` holds prompt + expected output ids."""

    layer_ids: tuple[int, ...] = ()

    def __init__(self, sequence: list[int], vocab_size: int):
        self.sequence = list(sequence)
        self.vocab_size = vocab_size

    def fuse(self, features):
        return features

    def prefill(self, context, capacity: int) -> None:
        pass

    def commit(self, context, position: int) -> None:
        pass

    def relay_rejected(self, context, tokens, accepted, bonus) -> None:
        pass

    def propose(self, anchor: torch.Tensor, position: int, size: int) -> torch.Tensor:
        ids = self.sequence[position + 1: position + size]
        ids = ids + [0] * (size - 1 - len(ids))
        logits = torch.full((1, size - 1, self.vocab_size), -1e4, device=anchor.device)
        logits[0, torch.arange(size - 1, device=anchor.device), torch.tensor(ids, device=anchor.device)] = 1e4
        return logits


def proposer_for(method: str, drafter: DFlowDrafter | None, target) -> DrafterProposer | None:
    """The proposer of a decoding method (None for `ar`), with one clear error for each misfit."""
    if method not in METHODS:
        raise DFlowError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    if method == "ar":
        return None
    if drafter is None:
        raise DFlowError(f"method {method} needs a drafter")
    return DrafterProposer(drafter, target, use_relay=method == "dflow")
