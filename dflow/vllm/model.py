"""The DFlow drafter inside vLLM: vLLM's DFlash drafter (`DFlashQwen3ForCausalLM`) plus our
`Relay` module, loaded from the same checkpoint `dflow train` writes (DFlash keys + `relay.*`).

It is selected for checkpoints whose config says `dflow_config.relay` (see `plugin`); the
DFlash part is vLLM's own code, unchanged. One difference in `forward`: the query embeddings are
computed here, outside the compiled decoder, so the compiled graph always takes `inputs_embeds`
and the proposer can hand it relayed rows (a graph traced with `inputs_embeds=None` would ignore them).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from vllm.config import VllmConfig
from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM

from dflow.relay import Relay

ARCHITECTURE = "DFlashDFlowDraftModel"  # vLLM renames draft architectures not starting/ending with "DFlash"
RELAY_PREFIX = "relay."


class DFlowDFlashForCausalLM(DFlashQwen3ForCausalLM):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        dflow = getattr(self.config, "dflow_config", None) or {}
        self.relay = Relay(self.config.hidden_size, int(dflow.get("relay_hidden_size", 0)))
        self.relay.to(vllm_config.model_config.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        if inputs_embeds is None:
            inputs_embeds = self.embed_input_ids(input_ids)  # [q, hidden]
        return self.model(input_ids, positions, inputs_embeds)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        relay: dict[str, torch.Tensor] = {}

        def dflash_only():
            for name, tensor in weights:
                if name.startswith(RELAY_PREFIX):
                    relay[name[len(RELAY_PREFIX):]] = tensor
                else:
                    yield name, tensor

        out = super().load_weights(dflash_only())
        if not relay:
            raise ValueError("DFlow drafter: dflow_config says relay, but the checkpoint has no relay.* weights")
        self.relay.load_state_dict(relay, strict=True)  # copies into the params (dtype cast)
        return out

    def relay_inputs(self, mask_embeds: torch.Tensor, bonus: torch.Tensor, rejected: torch.Tensor,
                     states: torch.Tensor) -> torch.Tensor:
        """Paper eq. 4-5 for n relayed rows. mask_embeds [n, hidden] (the rows' plain mask inputs);
        bonus, rejected [n] token ids (b, d_{a+1}); states [n, hidden] verifier states after `fc`
        -> block inputs [n, hidden]."""
        h = self.model.hidden_norm(states)  # [n, hidden]: hidden_norm(fc(.)), as for the context
        embed = self.model.embed_tokens
        x = self.relay(mask_embeds[:, None], embed(bonus), embed(rejected), h[:, None])  # [n, 1, hidden]
        return x[:, 0].to(mask_embeds.dtype)
