"""DFlow's relay in vLLM's DFlash proposer: the rejected rows of each request's verified block seed
the mask inputs of its next block (docs/DESIGN.md, "The relay", `dflow.relay`), batched over the requests.

vLLM already passes the proposer the verifier states of every scheduled token, rejected drafts
included (its padded drafter batch), plus the rejected count per request: the relay costs one
small MLP over those rows and no extra target forward. With a plain DFlash drafter, or with the
relay switched off (`additional_config={"dflow_relay": False}`), every method below defers to
vLLM's own code and nothing changes (a reduced draft vocabulary is the model's, `dflow.vllm.model`).
"""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import override
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.spec_decode.dflash import DFlashProposer

from dflow.vllm.launch import RELAY_SWITCH  # additional_config key; default on for DFlow checkpoints
from dflow.vllm.model import DFlowDFlashForCausalLM
from dflow.vllm.rows import RelayRows, relay_rows


class DFlowProposer(DFlashProposer):
    relay_on: bool = False  # set in load_model: a DFlow drafter and the switch on
    _relay: tuple[RelayRows, torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # this step's rows, states, b, d_{a+1}

    @override
    def load_model(self, target_model: torch.nn.Module) -> None:
        super().load_model(target_model)
        extra = self.vllm_config.additional_config
        wanted = bool(extra.get(RELAY_SWITCH, True)) if isinstance(extra, dict) else True
        dflow = isinstance(self.model, DFlowDFlashForCausalLM)
        if dflow:
            self.model.use_target_head()  # a reduced draft vocabulary's rows of the now shared head
        self.relay_on = wanted and dflow and self.model.relay is not None
        if self.relay_on and self.speculative_config.disable_padded_drafter_batch:
            raise ValueError("DFlow's relay needs the rejected rows: drop disable_padded_drafter_batch "
                             f"(or pass additional_config {{'{RELAY_SWITCH}': false}})")

    @override
    def set_inputs_first_pass(
        self,
        target_token_ids: torch.Tensor,  # [num_tokens] the verified block's inputs
        next_token_ids: torch.Tensor,  # [batch] bonus tokens b (the next anchors)
        target_positions: torch.Tensor,  # [num_tokens]
        target_hidden_states: torch.Tensor,  # [num_tokens, hidden] verifier states after fc
        token_indices_to_sample: torch.Tensor | None,
        cad: CommonAttentionMetadata,
        num_rejected_tokens_gpu: torch.Tensor | None,  # [batch] or None (no drafts verified)
    ) -> tuple[int, torch.Tensor, CommonAttentionMetadata]:
        self._relay = None
        if self.relay_on and num_rejected_tokens_gpu is not None:
            rows = relay_rows(cad.query_start_loc, num_rejected_tokens_gpu, 1 + self.num_speculative_tokens)
            if rows.src.numel():
                self._relay = (rows, target_hidden_states[rows.src], next_token_ids[rows.request],
                               target_token_ids[rows.first_rejected])
        return super().set_inputs_first_pass(target_token_ids, next_token_ids, target_positions,
                                              target_hidden_states, token_indices_to_sample, cad,
                                              num_rejected_tokens_gpu)

    @override
    def build_model_inputs_first_pass(self, num_tokens: int, num_input_tokens: int,
                                      mm_embed_inputs) -> tuple[dict[str, Any], int]:
        kwargs, n = super().build_model_inputs_first_pass(num_tokens, num_input_tokens, mm_embed_inputs)
        if self._relay is not None:
            rows, states, bonus, rejected = self._relay
            embeds = self.model.embed_input_ids(kwargs["input_ids"])  # [q, hidden]: bonus + mask rows
            embeds[rows.dst] = self.model.relay_inputs(embeds[rows.dst], bonus, rejected, states)
            kwargs["inputs_embeds"] = embeds
            self._relay = None
        return kwargs, n
