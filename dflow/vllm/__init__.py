"""DFlow inside vLLM (the `vllm` extra): a drafter architecture, a proposer, and the plugin that
registers both in every vLLM process.

- `plugin.register` (entry point `vllm.general_plugins`): registers the DFlow drafter
  architecture, swaps the DFlash proposer for `DFlowProposer`, and routes checkpoints that carry
  a relay (`dflow_config.relay`) to the DFlow architecture. Plain DFlash checkpoints and every
  other speculative method keep vLLM's own classes and code paths.
- `model.DFlowDFlashForCausalLM`: vLLM's DFlash drafter plus our `Relay` module and its weights.
- `proposer.DFlowProposer`: vLLM's DFlash proposer plus the relay of rejected verifier rows.
- `rows.relay_rows`: which rows move where (pure tensor code, importable without vLLM).
- `launch`: engine settings shared by `dflow serve`, `dflow bench-serve` and the tests.

Only `rows`, `launch` and `plugin` import without vLLM; `model` and `proposer` need it.
"""
