"""scripts/average_drafters.py: the mean of saved drafters' weights, refused across architectures."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_target

from dflow.errors import DFlowError
from dflow.model import DFlowDrafter, config_for_target, load_drafter, save_drafter

SCRIPT = Path(__file__).parents[1] / "scripts" / "average_drafters.py"
spec = importlib.util.spec_from_file_location("average_drafters", SCRIPT)
avg = importlib.util.module_from_spec(spec)
spec.loader.exec_module(avg)


def saved(target, folder: Path, seed: int, layers: int = 1, block: int = 4) -> Path:
    drafter = DFlowDrafter(config_for_target(target.config, layers, block, mask_token_id=3)).init_weights(seed)
    save_drafter(drafter, folder)
    return folder


def test_the_mean_of_drafters_whatever_their_block(tmp_path):
    target = tiny_target("llama")
    a, b = saved(target, tmp_path / "a", 1, block=4), saved(target, tmp_path / "b", 2, block=16)
    mean = avg.average([a, b]).state_dict()
    sa, sb = load_drafter(a).state_dict(), load_drafter(b).state_dict()
    assert any(not torch.equal(sa[k], sb[k]) for k in sa)
    for k, v in mean.items():
        assert torch.allclose(v, (sa[k] + sb[k]) / 2)


def test_drafters_of_other_architectures_are_refused(tmp_path):
    target = tiny_target("llama")
    a, b = saved(target, tmp_path / "a", 1, layers=1), saved(target, tmp_path / "b", 2, layers=2)
    with pytest.raises(DFlowError, match="different architectures"):
        avg.average([a, b])


def test_the_command_writes_a_drafter_that_loads(tmp_path):
    target = tiny_target("llama")
    a, b = saved(target, tmp_path / "a", 1), saved(target, tmp_path / "b", 2)
    run = subprocess.run([sys.executable, str(SCRIPT), str(a), str(b), "--out", str(tmp_path / "m"),
                          "--dtype", "bfloat16"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    mean = load_drafter(tmp_path / "m").state_dict()
    sa, sb = load_drafter(a).state_dict(), load_drafter(b).state_dict()
    for k, v in mean.items():
        assert torch.allclose(v, ((sa[k] + sb[k]) / 2).to(torch.bfloat16).float())
    one = subprocess.run([sys.executable, str(SCRIPT), str(a), "--out", str(tmp_path / "n")], capture_output=True, text=True)
    assert one.returncode != 0 and "two or more" in one.stderr
