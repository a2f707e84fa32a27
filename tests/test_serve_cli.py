"""`dflow serve` / `bench-serve` argument and environment checks (no engine started, no vLLM needed)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from dflow.cli import main
from dflow.errors import DFlowError
from dflow.vllm.bench import acceptance, counter_delta, spec_counters
from dflow.vllm.launch import engine_kwargs


@pytest.fixture
def no_vllm(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))


@pytest.mark.parametrize("command", ["serve", "bench-serve"])
def test_clear_error_without_the_extra(no_vllm, tiny_target_dir, capsys, tmp_path, command):
    argv = [command, "--target", str(tiny_target_dir)] + (["--out", str(tmp_path / "o")] if command == "bench-serve"
                                                            else ["--method", "ar"])
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: vLLM is not installed") and "make vllm" in err[0]


def test_engine_kwargs_per_method(drafter_dir, tmp_path):
    assert "speculative_config" not in engine_kwargs("T", "ar")
    on, off = engine_kwargs("T", "dflow", str(drafter_dir)), engine_kwargs("T", "dflash", str(drafter_dir))
    assert on["speculative_config"] == {"method": "dflash", "model": str(drafter_dir), "num_speculative_tokens": 3}
    assert on["additional_config"] == {"dflow_relay": True} and off["additional_config"] == {"dflow_relay": False}
    plain = tmp_path / "plain"  # a DFlash checkpoint: no dflow_config
    plain.mkdir()
    cfg = json.loads((drafter_dir / "config.json").read_text())
    del cfg["dflow_config"]
    (plain / "config.json").write_text(json.dumps(cfg))
    assert engine_kwargs("T", "dflash", str(plain))["speculative_config"]["model"] == str(plain)
    with pytest.raises(DFlowError, match="no relay"):
        engine_kwargs("T", "dflow", str(plain))
    with pytest.raises(DFlowError, match="needs a drafter"):
        engine_kwargs("T", "dflow")
    assert "gpu_memory_utilization" not in on  # vLLM's default unless asked
    assert engine_kwargs("T", "ar", memory_fraction=0.5)["gpu_memory_utilization"] == 0.5
    with pytest.raises(DFlowError, match="--memory-fraction"):
        engine_kwargs("T", "ar", memory_fraction=1.5)


METRICS = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 70.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 12.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 7.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 5.0
vllm:generation_tokens_total{engine="0",model_name="m"} 99.0
"""


def test_spec_counters_from_prometheus_text():
    after, before = spec_counters(METRICS), spec_counters("")
    assert after["num_drafts"] == 10 and after["accepted_per_pos"] == [7.0, 5.0]
    acc = acceptance(counter_delta(after, before))
    assert acc["tau"] == pytest.approx(2.2) and acc["accept_by_position"] == [0.7, 0.5]
    assert acceptance(counter_delta(before, before))["tau"] is None


def test_bench_serve_dflash_may_draft_with_its_own_drafter():
    import argparse

    from dflow.commands.bench_serve import method_args
    args = argparse.Namespace(drafter="runs/c", dflash_drafter="runs/a", target="T")
    assert method_args(args, "dflash").drafter == "runs/a" and method_args(args, "dflash").target == "T"
    assert method_args(args, "dflow").drafter == "runs/c" and method_args(args, "ar") is args
    same = argparse.Namespace(drafter="runs/c", dflash_drafter=None)
    assert method_args(same, "dflash").drafter == "runs/c"
