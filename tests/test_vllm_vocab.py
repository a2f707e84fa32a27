"""A reduced draft vocabulary inside vLLM (needs the `vllm` extra; skipped without it): lossless
against plain vLLM, and the same rounds as our own engine with the same drafter, which holds only
if vLLM scored the map's rows and mapped the drafts back to target ids (test_vllm.py's tiny setup)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="needs the vllm extra (make vllm)")
pytestmark = pytest.mark.vllm

from conftest import tiny_tokenizer, vllm_tiny_llama  # noqa: E402
from dflow.engine import generate  # noqa: E402
from dflow.model import DFlowDrafter, config_for_target, load_drafter, save_drafter  # noqa: E402
from dflow.proposers import DrafterProposer  # noqa: E402
from dflow.vllm.launch import engine_kwargs  # noqa: E402
from dflow.vllm.offline import shutdown, step_rounds  # noqa: E402

B, MAX_NEW = 8, 40
MAP = torch.tensor([0, 2, 4, 5, 6, 7, 9, 13, 17, 20, 25, 31, 40, 47, 52, 63])  # [16] of 64 target ids


def test_reduced_drafter_in_vllm_is_lossless_with_our_engines_rounds(tmp_path):
    from transformers import AutoModelForCausalLM
    from vllm import LLM

    target = vllm_tiny_llama(tmp_path, vocab=64, layers=6)
    with torch.no_grad():
        target.lm_head.weight[4:8] *= 3  # favoured tokens (in the map): a random drafter is accepted now and then
    target.generation_config.eos_token_id = 2
    target.save_pretrained(tmp_path / "target")
    tiny_tokenizer(64).save_pretrained(tmp_path / "target")
    cfg = config_for_target(target.config, 2, B, mask_token_id=3, relay=True)
    drafter = DFlowDrafter(cfg.__class__(**{**cfg.__dict__, "draft_vocab_size": MAP.numel()})).init_weights(1, std=0.3)
    drafter.dflash.d2t.copy_(MAP)
    with torch.no_grad():  # a relay that is not a no-op
        drafter.relay.mlp[2].weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    save_drafter(drafter, tmp_path / "drafter")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 64, (n,), generator=g).tolist() for n in (5, 17, 30)]

    runs = {}
    for method in ("ar", "dflow"):
        llm = LLM(**engine_kwargs(str(tmp_path / "target"), method, str(tmp_path / "drafter"), dtype="float32",
                                  max_model_len=512), enforce_eager=True)
        try:
            runs[method] = step_rounds(llm, prompts, MAX_NEW, 3)
        finally:
            shutdown(llm)
    assert [sum(c, []) for c in runs["dflow"]] == [sum(c, []) for c in runs["ar"]]

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "target", dtype=torch.float32).eval()
    loaded = load_drafter(tmp_path / "drafter")
    accepted = 0
    for i, p in enumerate(prompts):
        r = generate(hf, p, proposer=DrafterProposer(loaded, hf, use_relay=True), block_size=B, max_new_tokens=MAX_NEW)
        ours, done = [1], 1
        for x in r.rounds:  # full blocks only: at max_new_tokens our last rounds are shorter, vLLM's are not
            if done + B > MAX_NEW:
                break
            ours.append(x.committed)
            done += x.committed
        assert [len(c) for c in runs["dflow"][i]][: len(ours)] == ours, i
        accepted += sum(ours[1:]) - (len(ours) - 1)
    assert accepted > 5  # drafts were accepted: the map's ids reached vLLM's verifier
