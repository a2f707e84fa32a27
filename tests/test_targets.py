"""The alias cache: processes that start together (DDP ranks, parallel jobs) convert a GGUF once."""

from __future__ import annotations

import os
import threading
import time

import pytest

import dflow.targets as targets


def test_concurrent_first_uses_convert_once(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLOW_CACHE", str(tmp_path))
    calls = []

    def slow_convert(name, out):  # stands in for the dequantisation: slow, writes the two files last
        calls.append(name)
        time.sleep(0.3)
        out.mkdir(parents=True)
        (out / "model.safetensors").write_bytes(b"weights")
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(targets, "_convert", slow_convert)
    found = []
    workers = [threading.Thread(target=lambda: found.append(targets._alias_folder("smollm2-135m"))) for _ in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert calls == ["smollm2-135m"]
    assert found == [tmp_path / "targets" / "smollm2-135m"] * 3
    assert all((f / "config.json").exists() for f in found)  # nobody returned before the folder was whole
    targets._alias_folder("smollm2-135m")  # a later use is a cache hit
    assert calls == ["smollm2-135m"]


def _folder(path, *files):
    path.mkdir(parents=True)
    for f in files:
        (path / f).write_text(f)
    return path


def test_publish_never_touches_a_whole_folder(tmp_path):
    out = _folder(tmp_path / "m", "config.json", "model.safetensors")
    inode = (out / "config.json").stat().st_ino
    targets._publish(_folder(tmp_path / ".m-1", "config.json", "model.safetensors", "second"), out)
    assert (out / "config.json").stat().st_ino == inode and not (out / "second").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # the second conversion is dropped


def test_publish_replaces_a_partial_folder(tmp_path):
    out = _folder(tmp_path / "m", "config.json")  # a killed conversion's leftovers
    targets._publish(_folder(tmp_path / ".m-1", "config.json", "model.safetensors"), out)
    assert targets._converted(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    targets._publish(_folder(tmp_path / ".m-2", "config.json", "model.safetensors"), tmp_path / "new")
    assert targets._converted(tmp_path / "new")


def test_describe_device_names_the_cpu(monkeypatch):
    import torch
    text = targets.describe_device(torch.device("cpu"))
    assert text.startswith("cpu (") and text.endswith(")") and "unknown" not in text  # Linux: /proc/cpuinfo
    monkeypatch.setattr("builtins.open", lambda *a, **k: (_ for _ in ()).throw(OSError("no /proc")))
    assert targets.describe_device(torch.device("cpu")) == "cpu (unknown CPU)"


def _rank_loads_target(rank: int, cache: str, port: int, found) -> None:
    import torch.distributed as dist

    os.environ["DFLOW_CACHE"] = cache
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    if rank == 0:
        time.sleep(2)  # rank 1 takes the cache lock first: transformers saves only on rank 0
    model, _ = targets.load_target("smollm2-135m")
    found[rank] = float(model.lm_head.weight.float().abs().sum())
    dist.destroy_process_group()


@pytest.mark.real
def test_ddp_rank_one_converts_a_whole_folder(tmp_path):
    """A first start under torchrun where rank 1 converts: the folder must hold the weights."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    found = mp.Manager().dict()
    mp.spawn(_rank_loads_target, args=(str(tmp_path), port, found), nprocs=2)
    assert targets._converted(tmp_path / "targets" / "smollm2-135m")
    assert found[0] == found[1] > 0
