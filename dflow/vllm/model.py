"""The DFlow drafter inside vLLM: vLLM's DFlash drafter (`DFlashQwen3ForCausalLM`) plus our
`Relay` module, loaded from the same checkpoint `dflow train` writes (DFlash keys + `relay.*`).

It is selected for checkpoints whose `dflow_config` asks for a relay or a reduced draft vocabulary
(see `plugin`); the DFlash part is vLLM's own code, unchanged. A reduced drafter (`dflow.vocab`)
scores the rows d2t of the target's shared LM head and hands vLLM target-vocabulary logits, -inf
outside the map, so vLLM's greedy and probabilistic drafting and its verification stay as they
are (single-process only: the rows are taken from the whole head, not a tensor-parallel shard). One difference in `forward`: the query embeddings are
computed here, outside the compiled decoder, so the compiled graph always takes `inputs_embeds`
and the proposer can hand it relayed rows (a graph traced with `inputs_embeds=None` would ignore them).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from vllm.config import VllmConfig
from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM

from dflow.relay import Relay
from dflow.vocab import MAP_KEY, apply_head, draft_head, read_draft_map, to_target_logits

ARCHITECTURE = "DFlashDFlowDraftModel"  # vLLM renames draft architectures not starting/ending with "DFlash"
RELAY_PREFIX = "relay."


class DFlowDFlashForCausalLM(DFlashQwen3ForCausalLM):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        dflow = getattr(self.config, "dflow_config", None) or {}
        self.relay = None
        if dflow.get("relay"):
            self.relay = Relay(self.config.hidden_size, int(dflow.get("relay_hidden_size", 0)))
            self.relay.to(vllm_config.model_config.dtype)
        self.draft_vocab_size = int(dflow.get("draft_vocab_size", 0))  # 0: the full vocabulary
        self.d2t: torch.Tensor | None = None  # [N] target ids of the draft ids, from load_weights
        self.draft_rows: torch.nn.Module | None = None  # the shared head's rows d2t, from use_target_head

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        if inputs_embeds is None:
            inputs_embeds = self.embed_input_ids(input_ids)  # [q, hidden]
        return self.model(input_ids, positions, inputs_embeds)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        relay: dict[str, torch.Tensor] = {}
        vocab: dict[str, torch.Tensor] = {}

        def dflash_only():  # our `d2t` never reaches vLLM's loader (it would expect a draft-sized head)
            for name, tensor in weights:
                if name.startswith(RELAY_PREFIX):
                    relay[name[len(RELAY_PREFIX):]] = tensor
                elif name == MAP_KEY:
                    vocab[name] = tensor
                else:
                    yield name, tensor

        out = super().load_weights(dflash_only())
        if self.relay is not None:
            if not relay:
                raise ValueError("DFlow drafter: dflow_config says relay, but the checkpoint has no relay.* weights")
            self.relay.load_state_dict(relay, strict=True)  # copies into the params (dtype cast)
        if self.draft_vocab_size or vocab:
            if not vocab:
                raise ValueError(f"DFlow drafter: dflow_config.draft_vocab_size is {self.draft_vocab_size}, "
                                 f"but the checkpoint has no {MAP_KEY} map")
            d2t = read_draft_map(vocab[MAP_KEY], self.config.vocab_size, self.draft_vocab_size, "the drafter's weights")
            self.d2t = d2t.to(next(self.parameters()).device)
        return out

    def use_target_head(self) -> None:
        """After vLLM shares the target's LM head with the drafter (`load_model`): take its rows d2t."""
        if self.d2t is not None:
            self.draft_rows = draft_head(self.lm_head, self.d2t)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """hidden_states [n, hidden] -> logits [n, vocab]; a reduced drafter's are -inf outside its map."""
        if self.d2t is None:
            return super().compute_logits(hidden_states)
        return to_target_logits(apply_head(self.draft_rows, hidden_states), self.d2t, self.config.vocab_size)

    def get_top_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """vLLM's local-argmax path (`use_local_argmax_reduction`): the same argmax as compute_logits'."""
        if self.d2t is None:
            return super().get_top_tokens(hidden_states)
        return self.compute_logits(hidden_states).argmax(dim=-1)

    def relay_inputs(self, mask_embeds: torch.Tensor, bonus: torch.Tensor, rejected: torch.Tensor,
                     states: torch.Tensor) -> torch.Tensor:
        """Paper eq. 4-5 for n relayed rows. mask_embeds [n, hidden] (the rows' plain mask inputs);
        bonus, rejected [n] token ids (b, d_{a+1}); states [n, hidden] verifier states after `fc`
        -> block inputs [n, hidden]."""
        h = self.model.hidden_norm(states)  # [n, hidden]: hidden_norm(fc(.)), as for the context
        embed = self.model.embed_tokens
        x = self.relay(mask_embeds[:, None], embed(bonus), embed(rejected), h[:, None])  # [n, 1, hidden]
        return x[:, 0].to(mask_embeds.dtype)
