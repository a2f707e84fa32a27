"""Engine settings shared by `dflow serve`, `dflow bench-serve` and the tests (no vLLM import).

A method is `ar` (the target alone), `dflash` (the drafter, relay off) or `dflow` (relay on; the
drafter must carry relay weights). Both drafter methods run vLLM's `"dflash"` speculative method
with `num_speculative_tokens = block_size - 1`; the relay switch travels in `additional_config`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from dflow.errors import DFlowError
from dflow.proposers import METHODS
from dflow.relay import require_relay

RELAY_SWITCH = "dflow_relay"  # == dflow.vllm.proposer.RELAY_SWITCH


def require_vllm() -> None:
    """One clear error when the extra is missing."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise DFlowError("vLLM is not installed: run `make vllm` (or pip install -e \".[vllm]\" in a "
                         "separate venv, then pip uninstall -y torchvision torchaudio torchcodec)")


def drafter_info(drafter: str | os.PathLike) -> dict:
    """block_size and whether a relay ships, read from the checkpoint's config.json."""
    path = Path(drafter) / "config.json"
    if not path.exists():
        raise DFlowError(f"drafter folder {drafter} has no config.json")
    cfg = json.loads(path.read_text())
    dflash = cfg.get("dflash_config") or {}
    dflow = cfg.get("dflow_config") or {}
    return {"block_size": int(dflash.get("block_size", cfg.get("block_size", 16))), "relay": bool(dflow.get("relay"))}


def engine_kwargs(target: str, method: str, drafter: str | None = None, dtype: str = "bfloat16",
                  max_model_len: int = 2048, block_size: int | None = None,
                  memory_fraction: float | None = None) -> dict:
    """Keyword arguments of `vllm.LLM` / `EngineArgs` for one method. `memory_fraction` is vLLM's
    gpu_memory_utilization, which on CPU is the share of the NUMA node's memory vLLM insists is
    free at start-up (vLLM's default 0.92 refuses to start on a busy machine)."""
    if method not in METHODS:
        raise DFlowError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    if memory_fraction is not None and not 0 < memory_fraction <= 1:
        raise DFlowError(f"--memory-fraction must be in (0, 1], got {memory_fraction}")
    kwargs = {"model": target, "dtype": dtype, "max_model_len": max_model_len, "seed": 0}
    if memory_fraction is not None:
        kwargs["gpu_memory_utilization"] = memory_fraction
    if method == "ar":
        return kwargs
    if drafter is None:
        raise DFlowError(f"method {method} needs a drafter (--drafter DIR)")
    info = drafter_info(drafter)
    if method == "dflow":
        require_relay(info["relay"], str(drafter))
    block = block_size or info["block_size"]
    kwargs["speculative_config"] = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": block - 1}
    kwargs["additional_config"] = {RELAY_SWITCH: method == "dflow"}
    return kwargs


def cpu_env(cache_dir: str | os.PathLike, kv_cache_gib: int = 1, threads_bind: str | None = None) -> dict[str, str]:
    """Environment for a vLLM CPU engine: a small KV cache, a project cache folder, and (optionally)
    the cores its OpenMP threads bind to (vLLM syntax: "1" or "0-3"). Existing settings win."""
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "VLLM_CACHE_ROOT": str(cache_dir)}
    if threads_bind:
        env["VLLM_CPU_OMP_THREADS_BIND"] = threads_bind
    return {k: os.environ.get(k, v) for k, v in env.items()}
