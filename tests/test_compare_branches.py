"""scripts/compare_branches.py: paired by step, a gain in rounds 1..k shows through batch noise both
runs share, and no gain reads as not measurable."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("compare_branches",
                                              Path(__file__).parents[1] / "scripts" / "compare_branches.py")
cb = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cb)


def write_run(path: Path, noise: list[float], gain: float) -> Path:
    lines = []
    for step, n in enumerate(noise, start=1):
        rec = {"step": step, "loss": 1.0, "accepted_r0": 0.6 + n}
        rec.update({f"accepted_r{q}": 0.6 + n + gain + 0.01 * random.Random(step * 7 + q).random() for q in (1, 2)})
        lines.append(json.dumps(rec))
    lines.append(json.dumps({"step": len(noise), "eval_tau": 1.4}))  # an eval record is skipped
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_small_gain_under_large_shared_noise_is_measurable(tmp_path):
    noise = [random.Random(s).gauss(0, 0.3) for s in range(200)]  # batch noise, 10x the gain
    c = cb.steps_of(str(write_run(tmp_path / "c.jsonl", noise, 0.03)))
    b = cb.steps_of(str(write_run(tmp_path / "b.jsonl", noise, 0.0)))
    res = cb.compare(c, b, window=100, sigmas=3)
    assert res["window"] == [101, 200]
    assert res["rounds"]["r1..2"]["diff"] == pytest.approx(0.06, abs=0.005) and res["rounds"]["r1..2"]["measurable"]
    assert res["rounds"]["r0"]["diff"] == 0 and not res["rounds"]["r0"]["measurable"]
    same = cb.compare(b, b, window=100, sigmas=3)["rounds"]["r1..2"]
    assert same["diff"] == 0 and not same["measurable"]
    cb.plot(c, b, 100, 3, ("c", "b"), str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_two_dflash_runs_compare_on_round_0(tmp_path):
    """k = 0 on both sides (two learning rates of branch (a)): round 0 is the comparison."""
    def run(name, gain):
        lines = [json.dumps({"step": s, "loss": 1.0, "accepted_r0": 0.5 + gain + 0.2 * random.Random(s).random()})
                 for s in range(1, 41)]
        (tmp_path / name).write_text("\n".join(lines) + "\n")
        return cb.steps_of(str(tmp_path / name))
    hi, lo = run("hi.jsonl", 0.0), run("lo.jsonl", 0.1)
    res = cb.compare(lo, hi, window=40, sigmas=3)
    assert list(res["rounds"]) == ["r0"] and res["rounds"]["r0"]["diff"] == pytest.approx(0.1)
    assert res["rounds"]["r0"]["measurable"]
    cb.plot(lo, hi, 40, 3, ("lo", "hi"), str(tmp_path / "p.png"))


def test_runs_that_share_no_step_are_refused(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0, "accepted_r0": 0.5}) + "\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"step": 2, "loss": 1.0, "accepted_r0": 0.5}) + "\n")
    a, b = cb.steps_of(str(tmp_path / "a.jsonl")), cb.steps_of(str(tmp_path / "b.jsonl"))
    with pytest.raises(SystemExit, match="share no step"):
        cb.compare(a, b, 100, 3)
