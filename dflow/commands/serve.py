"""`dflow serve`: vLLM's OpenAI-compatible server on loopback, with the DFlow plugin.

`--method ar` serves the target alone; `dflash` the drafter with the relay off; `dflow` with it
on. The plugin (entry point `vllm.general_plugins`) loads itself in vLLM's processes; this command
only resolves the target and drafter, checks them, and execs vLLM's server.
"""

from __future__ import annotations

import json
import os
import sys

from dflow.drafter import check_block_size
from dflow.errors import DFlowError
from dflow.proposers import METHODS
from dflow.targets import DEFAULT_TARGET, cache_root, resolve_target
from dflow.vllm.launch import cpu_env, engine_kwargs, require_vllm

HOST = "127.0.0.1"


def add_server_args(p) -> None:
    """Options shared with `dflow bench-serve`."""
    p.add_argument("--target", default=DEFAULT_TARGET, help="alias, local HF folder or hub id")
    p.add_argument("--drafter", default=None, help="drafter folder (default: the one shipped for the target)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=None, help="draft block B (default: the drafter's); "
                                                                "vLLM drafts B-1 tokens")
    p.add_argument("--cpus", default=None, help="cores vLLM's OpenMP threads bind to, e.g. 1 or 0-3 "
                                                "(VLLM_CPU_OMP_THREADS_BIND; default: vLLM's auto)")
    p.add_argument("--kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--memory-fraction", type=float, default=None,
                   help="share of memory vLLM requires free at start (its --gpu-memory-utilization; default "
                        "0.92): lower it on a busy machine")
    p.add_argument("--enforce-eager", action="store_true", help="no torch.compile (starts faster, runs slower)")


def add_parser(sub) -> None:
    s = sub.add_parser("serve", help="serve the target with vLLM (ar / dflash / dflow), OpenAI-compatible API")
    s.add_argument("--method", choices=METHODS, default="dflow")
    s.add_argument("--port", type=int, default=8000)
    add_server_args(s)
    s.set_defaults(func=run_serve)


def resolve_drafter(target: str, drafter: str | None, method: str) -> str | None:
    if method == "ar":
        return None
    from dflow.pipeline import default_drafter_dir

    path = drafter or default_drafter_dir(target)
    if path is None:
        raise DFlowError(f"no trained drafter ships for {target!r} yet: pass --drafter DIR "
                         "(a `dflow train` or `dflow init-drafter` folder), or use --method ar")
    if not os.path.isdir(path):
        raise DFlowError(f"drafter folder {path} does not exist")
    return str(path)


def server_command(args, method: str, port: int) -> tuple[list[str], dict[str, str]]:
    """argv and environment of vLLM's OpenAI server for one method."""
    require_vllm()
    if args.block_size is not None:
        check_block_size(args.block_size, "--block-size")
    drafter = resolve_drafter(args.target, args.drafter, method)
    kw = engine_kwargs(resolve_target(args.target), method, drafter, args.dtype, args.max_model_len, args.block_size,
                       args.memory_fraction)
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", HOST, "--port", str(port),
            "--model", kw["model"], "--served-model-name", args.target, "--dtype", kw["dtype"],
            "--max-model-len", str(kw["max_model_len"]), "--seed", str(kw["seed"])]
    if "speculative_config" in kw:
        argv += ["--speculative-config", json.dumps(kw["speculative_config"]),
                 "--additional-config", json.dumps(kw["additional_config"])]
    if "gpu_memory_utilization" in kw:
        argv += ["--gpu-memory-utilization", str(kw["gpu_memory_utilization"])]
    if args.enforce_eager:
        argv.append("--enforce-eager")
    env = dict(os.environ)
    env.update(cpu_env(cache_root() / "vllm", args.kv_cache_gib, args.cpus))
    return argv, env


def run_serve(args) -> int:
    argv, env = server_command(args, args.method, args.port)
    print(f"[dflow] serving {args.target} ({args.method}) on http://{HOST}:{args.port}/v1", file=sys.stderr, flush=True)
    os.execve(argv[0], argv, env)  # the server owns the process from here (signals, shutdown)
