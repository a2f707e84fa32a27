"""DFlow inside vLLM (needs the `vllm` extra; skipped without it): lossless against plain vLLM,
the same relay as our own engine, and `dflow serve` answering an OpenAI-style chat request.

One tiny float32 target (head size 32: vLLM's CPU attention needs >= 32) with four favoured
tokens, so that a random drafter is sometimes right and rounds accept 0..B-1 drafts; a drafter
with random, non-trivial relay weights, so relay on and off draft differently. Three engines
(plain, DFlow relay on, relay off), each started once per module (~25 s each with enforce_eager).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.request

import pytest
import torch

pytest.importorskip("vllm", reason="needs the vllm extra (make vllm)")
pytestmark = pytest.mark.vllm

from conftest import tiny_tokenizer, vllm_tiny_llama  # noqa: E402
from dflow.engine import generate  # noqa: E402
from dflow.model import DFlowDrafter, config_for_target, load_drafter, save_drafter  # noqa: E402
from dflow.proposers import DrafterProposer  # noqa: E402
from dflow.vllm import bench  # noqa: E402
from dflow.vllm.launch import engine_kwargs  # noqa: E402
from dflow.vllm.offline import shutdown, step_rounds  # noqa: E402

B = 8
MAX_NEW = 48
PROMPT_LENGTHS = (5, 17, 30, 9)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(target dir, drafter dir) for vLLM: Llama, 6 layers, head size 32, float32."""
    root = tmp_path_factory.mktemp("vllm_tiny")
    target = vllm_tiny_llama(root, vocab=64, layers=6)
    cfg = target.config
    with torch.no_grad():
        target.lm_head.weight[4:8] *= 3  # favoured tokens: a random drafter is accepted now and then
    target.generation_config.eos_token_id = 2
    target.save_pretrained(root / "target")
    tiny_tokenizer(64).save_pretrained(root / "target")
    drafter = DFlowDrafter(config_for_target(cfg, 2, B, mask_token_id=3)).init_weights(1, std=0.3)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a relay that is not a no-op
        w = drafter.relay.mlp[2].weight
        w.copy_(torch.randn(w.shape, generator=g) * 0.5)
    save_drafter(drafter, root / "drafter")
    return root / "target", root / "drafter"


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(4, 64, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def runs(tiny):
    """method -> concurrency -> per-request chunks; one engine per method, shut down after use."""
    from vllm import LLM

    target, drafter = tiny
    out = {}
    for method in ("ar", "dflow", "dflash"):
        llm = LLM(**engine_kwargs(str(target), method, str(drafter), dtype="float32", max_model_len=512),
                  enforce_eager=True)
        try:
            out[method] = {c: step_rounds(llm, prompts(), MAX_NEW, c) for c in (1, 4)}
        finally:
            shutdown(llm)
    return out


def flat(chunks):
    return [sum(c, []) for c in chunks]


@pytest.mark.parametrize("method", ["dflow", "dflash"])
@pytest.mark.parametrize("concurrency", [1, 4])
def test_lossless_against_plain_vllm(runs, method, concurrency):
    reference = flat(runs["ar"][4])
    assert all(len(r) == MAX_NEW for r in reference)
    assert flat(runs[method][concurrency]) == reference
    assert flat(runs["ar"][1]) == reference


@pytest.mark.parametrize("method", ["dflow", "dflash"])
def test_same_rounds_as_our_engine(tiny, runs, method):
    """Per request, each round's committed count (accepted + 1) equals our engine's, in float32,
    at concurrency 1 and 4. Compared while our engine verifies full blocks: its last rounds use a
    shorter block at max_new_tokens, vLLM's do not."""
    from transformers import AutoModelForCausalLM

    target_dir, drafter_dir = tiny
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    drafter = load_drafter(drafter_dir)
    compared = accepted = 0
    for i, p in enumerate(prompts()):
        r = generate(target, p, proposer=DrafterProposer(drafter, target, use_relay=method == "dflow"),
                     block_size=B, max_new_tokens=MAX_NEW)
        ours, done = [1], 1
        for x in r.rounds:
            if done + B > MAX_NEW:
                break
            ours.append(x.committed)
            done += x.committed
        for c in (1, 4):
            theirs = [len(chunk) for chunk in runs[method][c][i]][: len(ours)]
            assert theirs == ours, (method, c, i)
        compared += len(ours) - 1
        accepted += sum(ours[1:]) - (len(ours) - 1)
    assert compared > 100 and accepted > 10  # the rounds did accept drafts: the relay was exercised


def test_relay_changes_the_drafts(runs):
    """Relay on and off accept differently on the same prompts: the relay reached the drafter."""
    on = [[len(c) for c in req] for req in runs["dflow"][4]]
    off = [[len(c) for c in req] for req in runs["dflash"][4]]
    assert on != off


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dflow_serve_answers_a_chat_completion(tiny):
    target, drafter = tiny
    port = _free_port()
    cmd = [sys.executable, "-m", "dflow.cli", "serve", "--target", str(target), "--drafter", str(drafter),
           "--method", "dflow", "--port", str(port), "--dtype", "float32", "--max-model-len", "512",
           "--enforce-eager"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        try:
            bench.wait_healthy(base, lambda: proc.poll() is None, timeout_s=240)
        except RuntimeError as e:
            pytest.fail(f"{e}: {proc.stdout.read()[-3000:] if proc.poll() is not None else ''}")
        body = {"model": str(target), "messages": [{"role": "user", "content": "w5 w6 w7"}], "max_tokens": 16,
                "temperature": 0}
        req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        reply = json.loads(urllib.request.urlopen(req, timeout=60).read())
        assert reply["object"] == "chat.completion"
        assert reply["usage"]["completion_tokens"] >= 1
        assert isinstance(reply["choices"][0]["message"]["content"], str)
        metrics = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
        assert "vllm:spec_decode_num_drafts" in metrics
    finally:
        bench.stop_server(proc, timeout_s=60)
