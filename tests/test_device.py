"""Decoding follows the target's device (tested on the CPU, with 'meta' as the default device), a
round makes no host sync beyond the one copy acceptance needs, and asking for CUDA where there is
none is one clear line. `scripts/gpu_check.sh` runs on the CPU too."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY_VOCAB, tiny_target
from test_engine import hf_greedy, prompts, random_drafter
from torch.utils._python_dispatch import TorchDispatchMode

from dflow.bench.pld import generate_pld
from dflow.cli import main
from dflow.drafter import ContextCache
from dflow.engine import generate
from dflow.errors import DFlowError
from dflow.pipeline import Pipeline
from dflow.proposers import DrafterProposer, OracleProposer
from dflow.sampling import SamplingParams
from dflow.targets import resolve_device

ROOT = Path(__file__).resolve().parents[1]
B = 8
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


def runs(target, prompt, ref):
    drafter = random_drafter(target)
    return {"ar": None, "dflash": DrafterProposer(drafter, target, False),
            "dflow": DrafterProposer(drafter, target, True), "oracle": OracleProposer(prompt + ref, TINY_VOCAB)}


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(1.0, 10, 0.9, seed=3)])
def test_every_tensor_follows_the_target_not_the_default_device(params):
    """With 'meta' as torch's default device, any tensor made without the target's device would
    be a meta tensor and the round would fail: decoding must not notice the default at all."""
    target = tiny_target("qwen3")
    prompt = prompts()[17]
    ref = hf_greedy(target, prompt, 40)
    for method, proposer in runs(target, prompt, ref).items():
        expect = generate(target, prompt, proposer=proposer, block_size=B, max_new_tokens=40, params=params)
        with torch.device("meta"):
            got = generate(target, prompt, proposer=proposer, block_size=B, max_new_tokens=40, params=params)
        assert got.token_ids == expect.token_ids, method
        if params.temperature == 0:
            assert got.token_ids == ref, method
    with torch.device("meta"):
        assert generate_pld(target, prompt, 40, []).token_ids == ref


class _HostSyncs(TorchDispatchMode):
    """Counts the ops that make the host wait for the device: a scalar read (.item(), int(),
    bool(), float()) and nonzero (boolean-mask indexing)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten._local_scalar_dense, torch.ops.aten.nonzero,
                                   torch.ops.aten.is_nonzero):
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("method", ["ar", "dflash", "dflow", "oracle"])
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(1.0, 10, 0.9, seed=3)])
def test_a_round_syncs_only_for_its_one_host_copy(method, params, monkeypatch):
    """No scalar read anywhere in decoding; one .tolist() per round (a and the committed ids) and
    one for the prefill's token."""
    target = tiny_target("llama")
    prompt = prompts()[16]
    ref = hf_greedy(target, prompt, 50)
    proposer = runs(target, prompt, ref)[method]
    copies = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: copies.append(self.shape) or tolist(self))
    with _HostSyncs() as syncs:
        r = generate(target, prompt, proposer=proposer, block_size=B, max_new_tokens=50, params=params)
    assert syncs.count == 0
    assert len(copies) == len(r.rounds) + 1


def test_context_cache_is_written_in_place():
    """Rounds write into the buffers made for the prompt: no copy of the context per round."""
    kv = [(torch.randn(1, 2, t, 4), torch.randn(1, 2, t, 4)) for t in (5, 3, 1, 2)]
    cache = ContextCache(capacity=12)
    cache.write([kv[0]], 0)
    storage = cache.k[0].data_ptr()
    position = 5
    for k, v in kv[1:]:
        cache.write([(k, v)], position)
        position += k.shape[2]
    assert cache.k[0].data_ptr() == storage and cache.length == 11
    (k, v), = cache.layers()
    torch.testing.assert_close(k, torch.cat([x[0] for x in kv], dim=2), rtol=0, atol=0)
    torch.testing.assert_close(v, torch.cat([x[1] for x in kv], dim=2), rtol=0, atol=0)
    cache.write([kv[1]], 11)  # past the capacity: the buffers grow, the context stays
    assert cache.length == 14 and cache.k[0].shape[2] >= 24
    torch.testing.assert_close(cache.layers()[0][0][:, :, :11], k, rtol=0, atol=0)


def test_the_engine_sizes_the_drafter_context_once():
    target = tiny_target("llama")
    proposer = DrafterProposer(random_drafter(target), target, True)
    prompt = prompts()[5]
    buffers = set()
    commit = proposer.commit
    proposer.commit = lambda features, position: (commit(features, position),
                                                  buffers.add(proposer.cache.k[0].data_ptr()))
    r = generate(target, prompt, proposer=proposer, block_size=B, max_new_tokens=60)
    assert len(r.rounds) > 5 and len(buffers) == 1
    assert proposer.cache.k[0].shape[2] == len(prompt) + 60


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(DFlowError, match="unknown device"):
        resolve_device("tpu")


@no_cuda
def test_cuda_without_cuda_is_a_clear_error(tiny_target_dir, drafter_dir, capsys):
    with pytest.raises(DFlowError, match="CUDA is not available"):
        resolve_device("cuda")
    for argv in (["generate", "w5 w6", "--target", str(tiny_target_dir), "--drafter", str(drafter_dir)],
                 ["bench", "--target", str(tiny_target_dir), "--out", "unused", "--datasets", "humaneval"]):
        assert main(argv + ["--device", "cuda"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error:") and "CUDA is not available" in err[0], err


def test_pipeline_loads_onto_the_device_asked_for(tiny_target_dir, drafter_dir):
    pipe = Pipeline.load(str(tiny_target_dir), str(drafter_dir), device="cpu")
    assert pipe.target.device.type == "cpu"
    assert {p.device.type for p in pipe.drafter.parameters()} == {"cpu"}
    ids = pipe.encode("w5 w6 w7", chat=False)
    assert pipe.generate(ids, "dflow", 8).token_ids == pipe.generate(ids, "ar", 8).token_ids


def test_gpu_check_script_runs_on_the_cpu():
    env = {**os.environ, "DEVICE": "cpu", "PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    summary = out.stdout.strip().splitlines()[-1]
    assert summary.startswith("gpu_check PASS device=cpu"), out.stdout
    assert "bf16 train s/step" in summary, summary


@pytest.mark.parametrize("native", [True, False])
def test_bf16_on_a_cpu_without_native_bf16_warns(tiny_target_dir, monkeypatch, native):
    """bf16 on an AVX2-only CPU runs matmuls ~80x slower than fp32: load_target says so, once, and
    loads anyway; a CPU with native bf16 (and any GPU) gets no warning."""
    import warnings

    import dflow.targets as targets

    monkeypatch.setattr(targets, "_cpu_has_bf16", lambda: native)
    assert targets.fast_bf16(torch.device("cuda"))
    assert targets.fast_bf16(torch.device("cpu")) is native
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, _ = targets.load_target(str(tiny_target_dir), "bfloat16", "cpu")
        targets.load_target(str(tiny_target_dir), "float32", "cpu")
    slow = [w for w in caught if "no native bf16" in str(w.message)]
    assert next(model.parameters()).dtype == torch.bfloat16
    assert len(slow) == (0 if native else 1)
    assert native or "--dtype float32" in str(slow[0].message)
