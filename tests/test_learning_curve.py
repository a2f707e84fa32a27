"""scripts/plot_learning_curve.py: core-hours and blocks from the per-step records, chained stages,
and the held-out tau gained over the last doubling of compute (issue 14's stopping rule)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("plot_learning_curve",
                                              Path(__file__).parents[1] / "scripts" / "plot_learning_curve.py")
curve = importlib.util.module_from_spec(spec)
spec.loader.exec_module(curve)


def write_run(folder: Path, steps: int, cpu_s: float, evals: dict[int, float]) -> Path:
    folder.mkdir(parents=True)
    lines = []
    for s in range(1, steps + 1):
        lines.append({"step": s, "loss": 1.0, "tokens": 10, "tokens_per_s": 10.0, "anchors_r0": 4,
                      "acc1_r0": 0.5, "accepted_r0": 0.25, "cpu_s": cpu_s})
        if s in evals:
            lines.append({"step": s, "eval_tau": evals[s]})
    if 0 in evals:
        lines.insert(0, {"step": 0, "eval_tau": evals[0]})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return folder


def test_a_chained_stage_continues_the_first_ones_blocks_and_core_hours(tmp_path):
    a = write_run(tmp_path / "a", 100, 36.0, {0: 1.0, 50: 1.2, 100: 1.3})  # 1 core-hour, 400 blocks
    b = write_run(tmp_path / "b", 100, 72.0, {0: 1.28, 100: 1.34})  # 2 more core-hours
    alone = curve.series([a, b])
    assert alone[1]["hours"][-1] == pytest.approx(2.0) and alone[1]["blocks"][-1] == 400
    chained = curve.series([a, b], chain=True)
    assert chained[1]["blocks"][0] == 404 and chained[1]["hours"][-1] == pytest.approx(3.0)
    assert chained[1]["points"][0] == (0, 400, pytest.approx(1.0), 1.28)  # step 0 sits at the stage's start
    gains = {(name, step): (half, gain) for name, step, _, _, half, gain in curve.doubling_gains(chained, chain=True)}
    half, gain = gains[("b", 100)]  # 3.0 core-h: nearest to 1.5 are a's end and b's start (1.0); the first counts
    assert half == pytest.approx(1.0) and gain == pytest.approx(1.34 - 1.3)
    assert gains[("a", 0)] == (None, None)
    half, gain = gains[("a", 100)]
    assert half == pytest.approx(0.5) and gain == pytest.approx(0.1)


def test_the_plot_is_written_and_the_gains_printed(tmp_path, capsys, monkeypatch):
    a = write_run(tmp_path / "a", 20, 360.0, {0: 1.0, 10: 1.2, 20: 1.25})
    out = tmp_path / "curve.png"
    monkeypatch.setattr("sys.argv", ["plot", str(a), "--out", str(out), "--smooth", "5"])
    curve.main()
    printed = capsys.readouterr().out
    assert out.stat().st_size > 1000
    assert "a step 20: 2.00 core-h, 80 blocks, held-out tau 1.250  +0.050 since 1.00 core-h; +0.050 since 40 blocks" in printed


def test_gains_by_blocks_and_a_metrics_file_as_a_run(tmp_path):
    a = write_run(tmp_path / "a", 100, 36.0, {0: 1.0, 50: 1.2, 100: 1.3})  # 400 blocks in 1 core-hour
    b = write_run(tmp_path / "b", 100, 360.0, {100: 1.34})  # a 10x slower machine: 10 core-hours, 400 blocks
    copy = tmp_path / "a-metrics.jsonl"
    copy.write_text((a / "metrics.jsonl").read_text())
    chained = curve.series([copy, b], chain=True)
    assert chained[0]["name"] == "a-metrics" and chained[1]["blocks"][-1] == 800
    assert curve.series([a / "metrics.jsonl"])[0]["name"] == "a"  # a snapshot's metrics.jsonl: its folder
    (_, _, x, _, half, gain), = [r for r in curve.doubling_gains(chained, True, axis="blocks") if r[0] == "b"]
    assert (x, half) == (800, 400) and gain == pytest.approx(1.34 - 1.3)  # a's end, not b's: half the blocks
    (_, _, x, _, half, _), = [r for r in curve.doubling_gains(chained, True) if r[0] == "b"]
    assert x == pytest.approx(11.0) and half == pytest.approx(1.0)  # by core-hours the nearest to 5.5 is a's end


def test_snapshot_readings_compare_only_like_with_like(tmp_path, capsys, monkeypatch):
    """--points FILE@HOURS: each reading's gain is since the like reading (same tokens, target dtype and
    block) nearest half its core-hours; a reading over 64 tokens, in float32 or in blocks of 4 is not a
    256-token bf16 one's in blocks of 16."""
    def reading(name, tau, tokens=256, dtype="bfloat16", block=16):
        (f := tmp_path / f"{name}.json").write_text(json.dumps({"tokens": tokens, "eval_tau": tau, "eval_dtype": dtype,
                                                                "block_size": block}))
        return str(f)

    specs = [f"{reading('a', 1.40)}@2.0", f"{reading('b', 1.50)}@5.0", f"{reading('c', 1.60, dtype='float32')}@9.0",
             f"{reading('d', 1.45, tokens=64)}@10.0", f"{reading('e', 1.70)}@10.5", f"{reading('f', 1.30, block=4)}@5.2",
             f"{reading('g', 1.31, block=4)}@10.6"]
    rows = {r["file"]: (half, gain) for r, half, gain in curve.snapshot_gains(curve.snapshot_points(specs))}
    half, gain = rows[str(tmp_path / "e.json")]
    assert half == 5.0 and gain == pytest.approx(0.2)  # not c (float32) nor d (64 tokens), nearer 5.25 than those
    assert rows[str(tmp_path / "g.json")] == (5.2, pytest.approx(0.01))  # blocks of 4: only f is like it
    assert rows[str(tmp_path / "a.json")] == (None, None) and rows[str(tmp_path / "d.json")] == (None, None)
    (old := tmp_path / "old.json").write_text(json.dumps({"tokens": 256, "eval_tau": 1.30}))  # no eval_dtype: bf16
    rows = {r["file"]: (half, gain) for r, half, gain in curve.snapshot_gains(curve.snapshot_points([*specs, f"{old}@1.5"]))}
    assert rows[str(tmp_path / "a.json")] == (1.5, pytest.approx(0.1))  # a bf16 reading that predates the field is like
    a = write_run(tmp_path / "run", 20, 360.0, {0: 1.0, 20: 1.25})
    monkeypatch.setattr("sys.argv", ["plot", str(a), "--out", str(tmp_path / "c.png"), "--points", *specs])
    curve.main()
    assert f"{tmp_path / 'e.json'} (256 tokens): 10.50 core-h, held-out tau 1.700  +0.200 since 5.00 core-h" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="expected FILE.json@HOURS"):
        curve.snapshot_points([str(tmp_path / "e.json")])


def test_snapshots_are_placed_by_blocks_when_chained(tmp_path, capsys, monkeypatch):
    """With --chain a snapshot reading is also placed by blocks trained (at the step nearest its
    core-hours) and its gain read by blocks: a GPU stage adds many blocks for few host core-hours."""
    cpu = write_run(tmp_path / "cpu", 100, 36.0, {})  # 400 blocks over 1 core-hour
    gpu = write_run(tmp_path / "gpu", 10, 0.36, {})  # 4,000 blocks (below) for 0.001 core-hours
    lines = [json.loads(x) for x in (gpu / "metrics.jsonl").read_text().splitlines()]
    (gpu / "metrics.jsonl").write_text("".join(json.dumps({**r, "anchors_r0": 400}) + "\n" for r in lines))
    curves = curve.series([cpu, gpu], chain=True)  # 4,400 blocks at 1.001 core-hours
    assert curve.blocks_at(curves, 0.5) == 200 and curve.blocks_at(curves, 1.001) == 4400
    assert curve.blocks_at(curves, 99.0) == 4400

    def reading(name, tau):
        (f := tmp_path / f"{name}.json").write_text(json.dumps({"tokens": 256, "eval_tau": tau}))
        return str(f)

    specs = [f"{reading('half', 1.5)}@0.5", f"{reading('end', 1.6)}@1.0", f"{reading('g', 1.9)}@1.001"]
    monkeypatch.setattr("sys.argv", ["plot", str(cpu), str(gpu), "--chain", "--out", str(tmp_path / "c.png"),
                                     "--points", *specs])
    curve.main()
    printed = capsys.readouterr().out
    # by core-hours g's nearest half (0.5005) is `half`; by blocks (2,200) it is `end` (400 is nearer than 200)
    assert (f"{tmp_path / 'g.json'} (256 tokens): 1.00 core-h, 4,400 blocks, held-out tau 1.900  +0.400 since "
            f"0.50 core-h; +0.300 since 400 blocks") in printed


def test_labels_give_the_block_only_where_the_runs_blocks_differ(tmp_path):
    a = write_run(tmp_path / "a", 10, 36.0, {})
    b = write_run(tmp_path / "b", 10, 36.0, {})
    (a / "config.json").write_text(json.dumps({"block_size": 16}))
    (b / "config.json").write_text(json.dumps({"block_size": 4}))
    bare = tmp_path / "c-metrics.jsonl"  # a committed copy: no config of its own
    bare.write_text((a / "metrics.jsonl").read_text())
    names = [c["name"] for c in curve.series([bare, a, b / "metrics.jsonl"], chain=True)]
    assert names == ["c-metrics", "a (blocks of 16)", "b (blocks of 4)"]
    (b / "config.json").write_text(json.dumps({"block_size": 16}))
    assert [c["name"] for c in curve.series([a, b], chain=True)] == ["a", "b"]
