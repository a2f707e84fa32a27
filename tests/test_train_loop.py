"""`dflow train` end to end on a tiny target folder: checkpoints, resume, NaN stop, DDP, bad input,
and that a trained DFlow drafter still decodes losslessly."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import tiny_target, tiny_tokenizer
from dflow import cli
from dflow.errors import DFlowError
from dflow.data.shards import FORMAT, id_dtype, shard_name, target_identity, write_meta, write_shard
from dflow.engine import generate
from dflow.model import load_drafter, save_drafter
from dflow.pipeline import init_drafter
from dflow.proposers import DrafterProposer
from dflow.train import TrainConfig
from dflow.train.batching import sample_anchors
from dflow.train.checkpoint import write_snapshot
from dflow.train.loop import Trainer, build_drafter, learning_rate
from dflow.train.rollout import Rollout

PROMPT, REPLY, NUM_SEQS = 6, 26, 12


def write_data(folder: Path, model, tokenizer, sequences) -> Path:
    """A `dflow data` folder of (ids, mask) lists for this target."""
    folder.mkdir(parents=True, exist_ok=True)
    write_shard(folder / shard_name(0), sequences, id_dtype(model.config.vocab_size), {},
                [str(i) for i in range(len(sequences))])
    write_meta(folder, {"format": FORMAT, "target": {"name": "tiny", **target_identity(model, tokenizer)},
                        "shards": [shard_name(0)], "complete": True})
    return folder


def trajectories(model, n=NUM_SEQS, seed=0):
    """The target's own greedy replies to random prompts: loss on the reply tokens."""
    prompts = torch.randint(4, model.config.vocab_size, (n, PROMPT), generator=torch.Generator().manual_seed(seed))
    out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=REPLY, do_sample=False,
                         pad_token_id=0, eos_token_id=None)
    return [(row.tolist(), [False] * PROMPT + [True] * REPLY) for row in out]


@pytest.fixture(scope="module")
def target_dir(tiny_target_dir):
    return tiny_target_dir


@pytest.fixture(scope="module")
def data_dir(target_dir, tmp_path_factory):
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    return write_data(tmp_path_factory.mktemp("data"), model, AutoTokenizer.from_pretrained(target_dir),
                      trajectories(model))


def args_for(target_dir, data_dir, out, *extra) -> list[str]:
    return ["train", "--target", str(target_dir), "--data", str(data_dir), "--out", str(out), "--layers", "2",
            "--block-size", "8", "--batch-size", "2", "--anchors-per-seq", "4", "--lr", "3e-3", "--save-every", "2",
            "--eval-samples", "2", "--eval-tokens", "8", "--dtype", "float32", "--no-bf16", "--no-progress", *extra]


def losses(out: Path) -> dict[int, dict]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records if "loss" in r}


def state_step(out: Path) -> int:
    return json.loads((out / "checkpoint" / "train_state.json").read_text())["step"]


def fail_at(monkeypatch, call: int, make):
    """Patch the rollout so that its `call`-th forward (1-based) goes wrong via make(loss)."""
    forward, count = Rollout.forward, [0]

    def patched(self, *args):
        count[0] += 1
        loss, stats = forward(self, *args)
        return (make(loss), stats) if count[0] == call else (loss, stats)

    monkeypatch.setattr(Rollout, "forward", patched)


@pytest.fixture(scope="module")
def reference(target_dir, data_dir, tmp_path_factory):
    """An uninterrupted 4-step DFlow run (k = 2, relay on) through the CLI."""
    out = tmp_path_factory.mktemp("reference")
    assert cli.main(args_for(target_dir, data_dir, out, "--max-steps", "4")) == 0
    return out


def test_run_writes_checkpoint_metrics_and_a_loadable_drafter(reference):
    assert state_step(reference) == 4
    recs = losses(reference)
    assert sorted(recs) == [1, 2, 3, 4]
    for key in ("loss_r0", "loss_r1", "loss_r2", "acc_r0", "acc_r2", "accepted_r1", "tokens_per_s"):
        assert key in recs[4]
    assert recs[4]["loss"] == pytest.approx(sum(recs[4][f"loss_r{q}"] for q in range(3)))
    evals = [json.loads(x) for x in (reference / "metrics.jsonl").read_text().splitlines() if "eval_tau" in x]
    assert evals and evals[-1]["step"] == 4 and evals[-1]["eval_tau"] >= 1.0 and evals[-1]["eval_method"] == "dflow"
    drafter = load_drafter(reference)  # what `dflow generate --drafter OUT` loads
    assert drafter.relay is not None and drafter.relay.mlp[2].weight.abs().sum() > 0  # the relay was trained
    assert not any(p.name.endswith((".pt", ".bin", ".pkl")) for p in reference.rglob("*"))


def test_trained_dflow_drafter_decodes_losslessly(reference, target_dir):
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    drafter = load_drafter(reference)
    prompt = torch.randint(4, 64, (9,), generator=torch.Generator().manual_seed(5)).tolist()
    ids = torch.tensor([prompt])
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                          pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()
    for relay in (True, False):
        got = generate(target, prompt, proposer=DrafterProposer(drafter, target, use_relay=relay),
                       block_size=drafter.cfg.block_size, max_new_tokens=20)
        assert got.token_ids == ref


def test_resume_reproduces_an_uninterrupted_run(target_dir, data_dir, reference, tmp_path, monkeypatch):
    out = tmp_path / "run"
    fail_at(monkeypatch, 3, lambda loss: (_ for _ in ()).throw(RuntimeError("simulated crash")))
    with pytest.raises(RuntimeError, match="simulated crash"):
        cli.main(args_for(target_dir, data_dir, out, "--max-steps", "4"))
    monkeypatch.undo()
    assert state_step(out) == 2
    assert cli.main(args_for(target_dir, data_dir, out, "--max-steps", "4", "--resume")) == 0
    ref, got = losses(reference), losses(out)
    assert sorted(got) == [1, 2, 3, 4]  # records of the crashed step 3 were not duplicated
    for step in (3, 4):
        for q in range(3):
            assert got[step][f"loss_r{q}"] == pytest.approx(ref[step][f"loss_r{q}"], rel=1e-6, abs=0)
    a, b = load_drafter(out).state_dict(), load_drafter(reference).state_dict()
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_stop_at_checkpoints_and_a_resume_finishes_the_same_run(target_dir, data_dir, reference, tmp_path, capsys):
    """--stop-at 3 of 4 (checkpoints every 2): a checkpoint at 3, the schedule of a 4-step run, and a resume
    that ends where the uninterrupted run does."""
    out = tmp_path / "run"
    assert cli.main(args_for(target_dir, data_dir, out, "--max-steps", "4", "--stop-at", "3")) == 0
    assert "stopped at step 3 of 4 (--stop-at)" in capsys.readouterr().err
    assert state_step(out) == 3 and sorted(losses(out)) == [1, 2, 3]
    assert losses(out)[3]["lr"] == pytest.approx(losses(reference)[3]["lr"])  # the 4-step schedule
    assert cli.main(args_for(target_dir, data_dir, out, "--max-steps", "4", "--resume", "--stop-at", "3")) == 2
    assert "--stop-at 3: the run is at step 3 of 4" in capsys.readouterr().err
    assert cli.main(args_for(target_dir, data_dir, out, "--max-steps", "4", "--resume")) == 0
    ref, got = losses(reference), losses(out)
    assert sorted(got) == [1, 2, 3, 4] and got[4]["loss_r0"] == pytest.approx(ref[4]["loss_r0"], rel=1e-6, abs=0)


def signal_self(loss):
    os.kill(os.getpid(), signal.SIGTERM)  # handled before the next line of Python runs
    return loss


def test_a_signal_mid_step_checkpoints_the_last_finished_step(target_dir, data_dir, reference, tmp_path,
                                                              monkeypatch, capsys):
    """SIGTERM during step 3's forward, no checkpoint due (--save-every 100): the run saves step 2, the
    last finished one, exits with 130 and says so; the resume ends where the uninterrupted run does."""
    out, before = tmp_path / "run", signal.getsignal(signal.SIGTERM)  # another test's handler, or the default
    fail_at(monkeypatch, 3, signal_self)
    assert cli.main(args_for(target_dir, data_dir, out, "--max-steps", "4", "--save-every", "100")) == 130
    assert "SIGTERM: stopped after step 2 of 4, which the checkpoint holds; rerun with --resume" in \
        capsys.readouterr().err
    monkeypatch.undo()
    assert signal.getsignal(signal.SIGTERM) is before  # the run's handler is gone with it
    assert state_step(out) == 2 and sorted(losses(out)) == [1, 2]
    assert cli.main(args_for(target_dir, data_dir, out, "--max-steps", "4", "--resume")) == 0
    ref, got = losses(reference), losses(out)
    assert sorted(got) == [1, 2, 3, 4]
    assert got[4]["loss_r0"] == pytest.approx(ref[4]["loss_r0"], rel=1e-6, abs=0)


def test_a_signal_during_the_update_waits_for_the_step_to_be_recorded(target_dir, data_dir, reference, tmp_path,
                                                                      monkeypatch, capsys):
    """SIGTERM inside step 3's optimizer update: the drafter is already at step 3, so the run records
    and saves step 3 (not 2 with step 3's weights) before it stops."""
    out = tmp_path / "run"
    update, calls = torch.optim.AdamW.step, [0]

    def step(self, *args, **kwargs):
        result = update(self, *args, **kwargs)
        calls[0] += 1
        if calls[0] == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return result

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    assert cli.main(args_for(target_dir, data_dir, out, "--max-steps", "4", "--save-every", "100")) == 130
    assert "stopped after step 3 of 4" in capsys.readouterr().err
    monkeypatch.undo()
    assert state_step(out) == 3 and sorted(losses(out)) == [1, 2, 3]
    assert cli.main(args_for(target_dir, data_dir, out, "--max-steps", "4", "--resume")) == 0
    assert losses(out)[4]["loss_r0"] == pytest.approx(losses(reference)[4]["loss_r0"], rel=1e-6, abs=0)


def test_sigterm_to_torchrun_checkpoints_the_last_finished_step(target_dir, data_dir, tmp_path):
    """torchrun passes SIGTERM on to its workers (and kills them 30 s later): the main one saves the
    last finished step at once, so stopping a DDP run loses only the step under way, and says so in
    one line (the other process stops quietly)."""
    out = tmp_path / "run"
    args = args_for(target_dir, data_dir, out, "--max-steps", "100000", "--save-every", "100000",
                    "--eval-samples", "0", "--rounds", "0")[1:]
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             "-m", "dflow.train", *args], env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stderr=subprocess.PIPE, text=True)
    steps = lambda: sum('"loss"' in line for line in (out / "metrics.jsonl").read_text().splitlines()[:-1])  # noqa: E731
    deadline = time.time() + 240
    while proc.poll() is None and time.time() < deadline and not ((out / "metrics.jsonl").exists() and steps() >= 2):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=120)[1]
    said = [line for line in err.splitlines() if line.startswith("interrupted:")]
    assert len(said) == 1 and said[0].startswith("interrupted: SIGTERM: stopped after step"), err[-3000:]  # once
    assert proc.returncode != 0 and state_step(out) == max(losses(out)) >= 2


def test_nan_loss_stops_with_one_line_and_keeps_the_last_good_checkpoint(target_dir, data_dir, tmp_path,
                                                                         monkeypatch, capsys):
    out = tmp_path / "run"
    fail_at(monkeypatch, 3, lambda loss: loss * float("nan"))
    assert cli.main(args_for(target_dir, data_dir, out, "--max-steps", "4")) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: step 3: non-finite loss or gradient") and "checkpoint" in err and "(step 2)" in err
    assert state_step(out) == 2 and sorted(losses(out)) == [1, 2]
    load_drafter(out)  # the published drafter is the step-2 one, whole


@pytest.mark.parametrize("rounds", ["2", "0"])
def test_ddp_two_processes_equal_one_process(target_dir, data_dir, tmp_path, rounds):
    """Global batch 4: one process x batch 4 vs two processes (gloo) x batch 2. The batches and
    anchors are the same by construction; losses agree to 1e-5 relative (padding differs, so the
    float sums are not bit-identical). k = 2 carries a relay that some steps leave unused; k = 0
    has none, and DDP runs without searching for unused parameters (one would stop it)."""
    common = ["--max-steps", "2", "--batch-size", "4", "--eval-samples", "0", "--rounds", rounds]
    one, two = tmp_path / "one", tmp_path / "two"
    assert cli.main(args_for(target_dir, data_dir, one, *common)) == 0
    args = args_for(target_dir, data_dir, two, *common)[1:]
    args[args.index("--batch-size", 12) + 1] = "2"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          "-m", "dflow.train", *args], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    a, b = losses(one), losses(two)
    assert sorted(a) == sorted(b) == [1, 2]
    for step in (1, 2):
        for key in ("loss_r0", "loss_r1", "loss_r2", "acc_r0", "acc_r1") if rounds == "2" else ("loss_r0", "acc_r0"):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-5), (step, key)
        assert b[step]["tokens"] == a[step]["tokens"]
        assert a[step]["cpu_s"] > 0 and b[step]["cpu_s"] > 0  # core-seconds of the step (over both ranks in b)


def test_resume_splits_the_global_batch_anew(target_dir, data_dir, tmp_path, capsys):
    """A run of global batch 4 checkpointed by one process (2 sequences x 2 accumulated micro-steps)
    resumes on two processes (2 x 1 each) and goes on as an uninterrupted one-process run (losses
    to 1e-5 relative: the float sums differ in order); a resume with another global batch is refused, naming both splits."""
    common = ["--max-steps", "3", "--eval-samples", "0", "--rounds", "0"]
    ref, out = tmp_path / "ref", tmp_path / "run"
    assert cli.main(args_for(target_dir, data_dir, ref, *common, "--batch-size", "4")) == 0
    assert cli.main(args_for(target_dir, data_dir, out, *common, "--grad-accum", "2", "--stop-at", "1")) == 0
    assert cli.main(args_for(target_dir, data_dir, out, *common, "--batch-size", "3", "--resume")) == 2
    err = capsys.readouterr().err
    assert "global batch 4 (--batch-size 2 x --grad-accum 2 x 1 processes) -> 3 (--batch-size 3 x --grad-accum 1" in err
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          "-m", "dflow.train", *args_for(target_dir, data_dir, out, *common, "--resume")[1:]],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "split anew: 2 x 2 micro-steps x 1 processes -> 2 x 1 x 2" in run.stderr
    a, b = losses(ref), losses(out)
    assert sorted(b) == [1, 2, 3] and state_step(out) == 3
    for step in (2, 3):
        assert b[step]["loss_r0"] == pytest.approx(a[step]["loss_r0"], rel=1e-5) and b[step]["tokens"] == a[step]["tokens"]


def test_resume_from_a_snapshot_goes_on_with_the_run(target_dir, data_dir, tmp_path, capsys):
    """A lost machine: the run's committed snapshot (bf16 drafter, step, settings, metrics; no optimizer) goes on
    in a new folder at its step, with the uninterrupted run's schedule and data order and a fresh optimizer whose
    rate ramps in again over --warmup steps (kept across a later --resume); the machine's dtype may change, other
    settings are refused, and so are a snapshot without a step and a finished run."""
    common = ["--max-steps", "6", "--warmup", "3", "--eval-samples", "0", "--rounds", "0"]
    ref, lost, snap, on = tmp_path / "ref", tmp_path / "lost", tmp_path / "snap", tmp_path / "on"
    assert cli.main(args_for(target_dir, data_dir, ref, *common)) == 0
    assert cli.main(args_for(target_dir, data_dir, lost, *common, "--stop-at", "3")) == 0
    assert write_snapshot(lost, snap) == 3 and sorted(losses(snap)) == [1, 2, 3]
    assert not (snap / "optimizer.safetensors").exists() and "param_groups" not in (snap / "train_state.json").read_text()
    capsys.readouterr()
    for extra, message in ((["--lr", "1e-3"], "--resume-from with other settings than the snapshot's (--lr 0.003 -> 0.001)"),
                           (["--resume"], "give --resume (OUT's checkpoint) or --resume-from (a snapshot), not both")):
        assert cli.main(args_for(target_dir, data_dir, on, *common, "--resume-from", str(snap), *extra)) == 2
        assert message in capsys.readouterr().err
    save_drafter(load_drafter(ref), tmp_path / "weights")  # a drafter alone: no step to go on from
    assert cli.main(args_for(target_dir, data_dir, on, *common, "--resume-from", str(tmp_path / "weights"))) == 2
    assert "no train_state.json there" in capsys.readouterr().err
    assert write_snapshot(ref, tmp_path / "done") == 6
    assert cli.main(args_for(target_dir, data_dir, on, *common, "--resume-from", str(tmp_path / "done"))) == 2
    assert "the run is at step 6 of 6, nothing left to train" in capsys.readouterr().err

    assert cli.main(args_for(target_dir, data_dir, on, *common, "--resume-from", str(snap), "--stop-at", "4")) == 0
    err = capsys.readouterr().err
    assert f"resuming the run of {snap} at step 3 from its weights, with a fresh optimizer" in err
    assert "its rate ramps in again over 3 steps" in err
    assert cli.main(args_for(target_dir, data_dir, on, *common, "--resume")) == 0  # the ramp outlives a resume
    a, b = losses(ref), losses(on)
    assert sorted(b) == [1, 2, 3, 4, 5, 6] and all(b[s] == losses(snap)[s] for s in (1, 2, 3))
    assert [b[s]["tokens"] for s in (4, 5, 6)] == [a[s]["tokens"] for s in (4, 5, 6)]  # the same data order
    for step, ramp in ((4, 1 / 3), (5, 2 / 3), (6, 1.0)):
        assert b[step]["lr"] == pytest.approx(a[step]["lr"] * ramp) == learning_rate(step - 1, 6, 3e-3, 3, 3)
    assert b[4]["loss_r0"] == pytest.approx(a[4]["loss_r0"], rel=2e-2)  # the snapshot's weights (bf16-rounded)
    assert b[4]["loss_r0"] != a[4]["loss_r0"] and b[6]["loss_r0"] != a[6]["loss_r0"]
    assert json.loads((on / "checkpoint" / "train_state.json").read_text())["fresh_at"] == 3

    other = tmp_path / "other-machine"  # --bf16 where the run had --no-bf16: allowed, and said
    assert cli.main(args_for(target_dir, data_dir, other, *common, "--resume-from", str(snap), "--bf16",
                             "--stop-at", "4")) == 0
    assert "--bf16 False -> True" in capsys.readouterr().err and state_step(other) == 4


def test_resume_may_draw_more_anchors_a_sequence(target_dir, data_dir, tmp_path, capsys):
    """--anchors-per-seq may change on --resume (the cheaper density depends on the machine): the log says so,
    the data order stays the run's, each sequence's anchors are the earlier draw and more (a prefix of one
    permutation), and the checkpoint then holds the new count; any other change is still refused."""
    mask = torch.tensor([False] * 3 + [True] * 40)
    draws = [sample_anchors(mask, n, torch.Generator().manual_seed(5)) for n in (4, 8)]
    assert set(draws[0].tolist()) < set(draws[1].tolist()) and len(draws[1]) == 8

    common = ["--max-steps", "3", "--eval-samples", "0", "--rounds", "0"]
    ref, out = tmp_path / "ref", tmp_path / "run"
    assert cli.main(args_for(target_dir, data_dir, ref, *common)) == 0
    assert cli.main(args_for(target_dir, data_dir, out, *common, "--stop-at", "1")) == 0
    capsys.readouterr()
    assert cli.main(args_for(target_dir, data_dir, out, *common, "--resume", "--anchors-per-seq", "8", "--lr", "1e-3")) == 2
    assert "(--lr 0.003 -> 0.001)" in capsys.readouterr().err
    assert cli.main(args_for(target_dir, data_dir, out, *common, "--resume", "--anchors-per-seq", "8", "--stop-at", "2")) == 0
    assert "resuming " in (err := capsys.readouterr().err) and "at step 1; --anchors-per-seq 4 -> 8" in err
    assert cli.main(args_for(target_dir, data_dir, out, *common, "--resume", "--anchors-per-seq", "8")) == 0
    assert "--anchors-per-seq" not in capsys.readouterr().err  # the checkpoint now holds 8
    a, b = losses(ref), losses(out)
    assert sorted(b) == [1, 2, 3] and b[1]["loss_r0"] == a[1]["loss_r0"]
    for step in (2, 3):
        assert b[step]["tokens"] == a[step]["tokens"] and b[step]["anchors_r0"] > a[step]["anchors_r0"]


@pytest.fixture(scope="module")
def other_target_data(tmp_path_factory):
    model = tiny_target("llama", vocab=80)
    return write_data(tmp_path_factory.mktemp("other"), model, tiny_tokenizer(80), trajectories(model, 4))


@pytest.mark.parametrize("case, message", [
    ("missing", "does not exist"),
    ("empty", "holds no training data"),
    ("other_target", "built for another target"),
    ("rounds", "--rounds must be >= 0"),
    ("block", "--block-size must be in 2..64"),
    ("lr", "--lr must be > 0"),
    ("steps", "--max-steps must be >= 1"),
    ("max_len", "exceeds the target's context"),
    ("resume", "holds no checkpoint"),
    ("out_file", "is a file, not a folder"),
    ("out_under_file", "is a file, not a folder"),
])
def test_bad_input_is_one_clear_line(case, message, target_dir, data_dir, other_target_data, tmp_path, capsys):
    out, data, extra = tmp_path / "out", data_dir, []
    if case == "missing":
        data = tmp_path / "nope"
    elif case == "empty":
        (data := tmp_path / "empty").mkdir()
    elif case == "other_target":
        data = other_target_data
    elif case.startswith("out_"):
        (tmp_path / "file").write_text("mine")
        out = tmp_path / "file" if case == "out_file" else tmp_path / "file" / "run"
    else:
        extra = {"rounds": ["--rounds", "-1"], "block": ["--block-size", "1"], "lr": ["--lr", "0"],
                 "steps": ["--max-steps", "0"], "resume": ["--resume"],
                 "max_len": ["--max-len", "100000"]}[case]
    assert cli.main(args_for(target_dir, data, out, *extra)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and message in err[-1] and "Traceback" not in "".join(err)
    assert not (tmp_path / "file").exists() or (tmp_path / "file").read_text() == "mine"


def test_init_from_a_dflash_drafter_grows_a_noop_relay(target_dir, tmp_path):
    target = AutoModelForCausalLM.from_pretrained(target_dir)
    dflash = init_drafter(target, layers=2, block_size=8, relay=False)
    save_drafter(dflash, tmp_path / "dflash")
    cfg = TrainConfig(target=str(target_dir), data="unused", out="unused", init=str(tmp_path / "dflash"))
    grown = build_drafter(cfg, target, None)
    assert grown.relay is not None and grown.relay.mlp[2].weight.abs().sum() == 0  # untrained relay = no-op
    assert all(torch.equal(v, dflash.dflash.state_dict()[k]) for k, v in grown.dflash.state_dict().items())
    assert build_drafter(replace(cfg, rounds=0), target, None).relay is None
    reblocked = build_drafter(replace(cfg, block_size=4, rounds=0), target, None)  # --init's weights, blocks of 4
    assert reblocked.cfg.block_size == 4 and load_drafter(tmp_path / "dflash").cfg.block_size == 8
    assert reblocked.state_dict().keys() == dflash.state_dict().keys()
    assert all(torch.equal(v, dflash.state_dict()[k]) for k, v in reblocked.state_dict().items())
    with pytest.raises(DFlowError, match="--layers 3 differs from --init's 2"):
        build_drafter(replace(cfg, layers=3), target, None)


def test_existing_run_needs_resume_and_same_settings(reference, target_dir, data_dir, capsys):
    assert cli.main(args_for(target_dir, data_dir, reference, "--max-steps", "4")) == 2
    assert "pass --resume" in capsys.readouterr().err
    assert cli.main(args_for(target_dir, data_dir, reference, "--max-steps", "4", "--resume", "--rounds", "1")) == 2
    assert "--rounds 2 -> 1" in capsys.readouterr().err


def test_long_and_unsupervised_sequences_are_counted(target_dir, tmp_path, capsys):
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    seqs = trajectories(model, 6)
    seqs[0] = (seqs[0][0], [False] * len(seqs[0][0]))  # no assistant tokens
    data = write_data(tmp_path / "data", model, AutoTokenizer.from_pretrained(target_dir), seqs)
    args = args_for(target_dir, data, tmp_path / "out", "--max-steps", "1", "--max-len", "20", "--eval-samples", "0",
                    "--rounds", "1", "--bf16")
    assert cli.main(args) == 0
    assert "5 training sequences, 0 held out; 6 truncated to --max-len, 1 skipped" in capsys.readouterr().err


def test_fused_target_layers_are_a_config_choice(tmp_path, capsys):
    """`--target-layers N` on `dflow init-drafter` and `dflow train`: N target layers spread as
    DFlash spreads them, independent of the drafter's depth; resume and --init keep it."""
    folder = tmp_path / "deep"
    model = tiny_target("llama", layers=8)
    model.generation_config.eos_token_id = 2
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    data = write_data(tmp_path / "data", model, tiny_tokenizer(), trajectories(model, 4))
    assert cli.main(["init-drafter", "--target", str(folder), "--layers", "1", "--target-layers", "3",
                     "--block-size", "8", "--out", str(tmp_path / "init")]) == 0
    init = load_drafter(tmp_path / "init")
    assert init.cfg.num_hidden_layers == 1 and init.cfg.target_layer_ids == (1, 3, 5)
    assert init.dflash.fc.weight.shape == (32, 3 * 32)
    out = tmp_path / "run"
    common = ["--max-steps", "1", "--eval-samples", "0", "--layers", "2"]
    assert cli.main(args_for(folder, data, out, *common, "--target-layers", "4")) == 0
    assert load_drafter(out).cfg.target_layer_ids == (1, 2, 4, 5)  # round(1 + i * 4/3)
    assert cli.main(args_for(folder, data, out, "--resume", *common, "--target-layers", "3")) == 2
    assert "--target-layers 4 -> 3" in capsys.readouterr().err
    for extra, message in ((["--init", str(tmp_path / "init"), "--target-layers", "2"], "--target-layers 2 differs"),
                           (["--target-layers", "9"], "--target-layers must be in 1..8"),
                           (["--target-layers", "0"], "--target-layers must be >= 1")):
        argv = args_for(folder, data, tmp_path / "bad", *common, *extra)
        argv[argv.index("--layers", 12) + 1] = "1"  # --init's depth
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith("error: ") and message in err


def test_rounds_whose_anchors_all_stopped_are_recorded_as_empty(target_dir, tmp_path):
    """2-token replies: one anchor per sequence, which stops after round 0. Training goes on, and
    the records say rounds 1 and 2 were empty (zero anchors, loss, accuracy), with no NaN."""
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    seqs = [(ids[:PROMPT + 2], mask[:PROMPT + 2]) for ids, mask in trajectories(model, 4)]
    data = write_data(tmp_path / "data", model, AutoTokenizer.from_pretrained(target_dir), seqs)
    assert cli.main(args_for(target_dir, data, tmp_path / "out", "--max-steps", "2", "--eval-samples", "0")) == 0
    for rec in losses(tmp_path / "out").values():
        assert rec["anchors_r0"] == 2 and rec["loss_r0"] > 0
        assert all(rec[f"{k}_r{q}"] == 0 for k in ("anchors", "loss", "acc", "accepted") for q in (1, 2))
        assert rec["loss"] == rec["loss_r0"]


def test_a_truncated_checkpoint_names_the_file_and_the_way_on(reference, target_dir, data_dir, tmp_path, capsys):
    def resume_error(out):
        assert cli.main(args_for(target_dir, data_dir, out, "--max-steps", "5", "--resume")) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("error: ") and "Traceback" not in "".join(err)
        return err[-1]

    def truncate(file):
        data = file.read_bytes()
        file.write_bytes(data[: len(data) // 2])

    for name, way in [("optimizer.safetensors", "its drafter is whole: --init"),
                      ("train_state.json", "its drafter is whole: --init"),
                      ("model.safetensors", "no earlier checkpoint is kept: start again with another --out")]:
        out = tmp_path / Path(name).stem
        shutil.copytree(reference, out)
        truncate(out / "checkpoint" / name)
        err = resume_error(out)
        assert str(out / "checkpoint" / name) in err and way in err, err
    out = tmp_path / "kept"  # a previous checkpoint kept beside the broken one is named, and resumes
    shutil.copytree(reference, out)
    shutil.copytree(out / "checkpoint", out / ".checkpoint-old")
    truncate(out / "checkpoint" / "model.safetensors")
    err = resume_error(out)
    assert f"the previous checkpoint {out / '.checkpoint-old'} is kept: remove {out / 'checkpoint'}" in err, err
    shutil.rmtree(out / "checkpoint")
    assert cli.main(args_for(target_dir, data_dir, out, "--max-steps", "5", "--resume", "--eval-samples", "2")) == 0
    assert state_step(out) == 5


def test_resume_drops_a_torn_last_metrics_line(reference, target_dir, data_dir, tmp_path):
    """A run killed while appending to metrics.jsonl resumes; the torn record goes."""
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    with (out / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "lo')
    assert cli.main(args_for(target_dir, data_dir, out, "--max-steps", "5", "--resume")) == 0
    assert sorted(losses(out)) == [1, 2, 3, 4, 5]


def test_compile_flag_compiles_the_drafter_layers_and_trains(target_dir, data_dir, tmp_path):
    """`--compile`: the run's drafter layers are compiled; training and the held-out tau (the
    engine, eval mode: eager) work; the saved drafter loads as any other."""
    out = tmp_path / "run"
    compiled = []
    step = Trainer.train_step

    def spy(self, i):
        compiled.append(self.drafter.dflash.compiled is not None)
        return step(self, i)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Trainer, "train_step", spy)
        assert cli.main(args_for(target_dir, data_dir, out, "--max-steps", "2", "--compile")) == 0
    assert compiled == [True, True]
    assert sorted(losses(out)) == [1, 2] and load_drafter(out).dflash.compiled is None


def test_draft_vocab_is_counted_over_the_data(target_dir, data_dir, tmp_path, capsys):
    """`init-drafter --draft-vocab N --data DIR` and `train --draft-vocab N` (over the training
    split) store the N most frequent supervised ids; the trained drafter keeps its map; with --init
    the given drafter is re-mapped (all its weights kept)."""
    from dflow.data import open_dataset
    from dflow.vocab import count_supervised, pick_draft_vocab

    model = AutoModelForCausalLM.from_pretrained(target_dir)
    sequences = open_dataset(data_dir)
    assert cli.main(["init-drafter", "--target", str(target_dir), "--layers", "1", "--block-size", "4",
                     "--draft-vocab", "12", "--data", str(data_dir), "--out", str(tmp_path / "d")]) == 0
    assert "draft vocabulary 12" in capsys.readouterr().out
    want = pick_draft_vocab(count_supervised(sequences, model.config.vocab_size), 12)
    assert torch.equal(load_drafter(tmp_path / "d").dflash.d2t, want)
    assert cli.main(["init-drafter", "--target", str(target_dir), "--draft-vocab", "12",
                     "--out", str(tmp_path / "e")]) == 2  # DFlowError: exit status 2
    assert "--draft-vocab N and --data DIR go together" in capsys.readouterr().err

    assert cli.main(args_for(target_dir, data_dir, tmp_path / "run", "--max-steps", "1", "--draft-vocab", "10",
                             "--eval-samples", "2")) == 0
    train_split = [sequences[i] for i in range(len(sequences) - 2)]  # the last 2 are held out
    want = pick_draft_vocab(count_supervised(train_split, model.config.vocab_size), 10)
    assert torch.equal(load_drafter(tmp_path / "run").dflash.d2t, want)

    # --init's drafter re-mapped: the new map, every weight carried over (the head is the target's)
    for vocab, size in (("10", 10), ("full", 0)):
        out = tmp_path / f"remap-{vocab}"
        args = args_for(target_dir, data_dir, out, "--max-steps", "1", "--draft-vocab", vocab, "--init",
                        str(tmp_path / "d"), "--layers", "1", "--block-size", "4", "--lr", "1e-12", "--rounds", "0")
        assert cli.main(args) == 0
        remapped, init = load_drafter(out), load_drafter(tmp_path / "d")
        assert remapped.cfg.draft_vocab_size == size
        assert (remapped.dflash.d2t is None) if size == 0 else torch.equal(remapped.dflash.d2t, want)
        weights = {k: v for k, v in init.state_dict().items() if k != "dflash.d2t"}
        assert all(torch.allclose(remapped.state_dict()[k], v, atol=1e-6) for k, v in weights.items())

    # --init's drafter re-blocked: trained on blocks of 8 (a DFlow run: the relay grown), saved as drafting them
    out = tmp_path / "reblocked"
    assert cli.main(args_for(target_dir, data_dir, out, "--max-steps", "1", "--init", str(tmp_path / "d"),
                             "--layers", "1", "--block-size", "8", "--eval-samples", "2", "--eval-tokens", "4")) == 0
    assert ", block 8, " in "".join(capsys.readouterr())
    assert load_drafter(out).cfg.block_size == 8 and load_drafter(out).relay is not None


def test_default_recipe_and_settings_a_checkpoint_predates(reference, target_dir, data_dir, tmp_path, capsys):
    """`dflow train`'s defaults are the measured recipe (docs/training.md); the draft vocabulary
    defaults to 8K ids only where the target's is larger (`full` keeps the whole one); a checkpoint
    written before a setting existed counts as trained with its old behaviour, so it resumes only
    with that (here: DFlash's loss weighting, no block bias)."""
    from dflow.commands.train import draft_vocab_arg, loss_gamma_arg
    from dflow.train.loop import draft_vocab_size

    cfg = TrainConfig(target="t", data="d", out="o")
    assert (cfg.lr, cfg.batch_size, cfg.anchors_per_seq, cfg.loss_gamma, cfg.block_bias, cfg.dtype, cfg.bf16,
            cfg.loss) == (1.2e-3, 2, 128, 1.0, 4.0, "bfloat16", True, "ce")
    big, small = SimpleNamespace(config=SimpleNamespace(vocab_size=49152)), SimpleNamespace(config=SimpleNamespace(vocab_size=300))
    assert draft_vocab_size(cfg, big) == 8192 and draft_vocab_size(cfg, small) is None
    assert draft_vocab_size(replace(cfg, draft_vocab=draft_vocab_arg("full")), big) is None
    assert draft_vocab_size(replace(cfg, draft_vocab=100), big) == 100
    assert loss_gamma_arg("dflash") is None and loss_gamma_arg("2") == 2.0
    from dflow.pipeline import default_target_layers
    assert (default_target_layers(2, 30), default_target_layers(8, 30), default_target_layers(2, 3)) == (5, 8, 3)
    tiny = AutoModelForCausalLM.from_pretrained(target_dir)
    fresh = init_drafter(tiny)
    assert fresh.cfg.num_hidden_layers == 2
    assert len(fresh.cfg.target_layer_ids) == min(5, tiny.config.num_hidden_layers)

    old = tmp_path / "old"
    shutil.copytree(reference, old)
    state_file = old / "checkpoint" / "train_state.json"
    state = json.loads(state_file.read_text())
    for key in ("loss_gamma", "block_bias", "block_bias_steps", "loss"):  # as written before these existed
        state["config"].pop(key)
    state_file.write_text(json.dumps(state))
    assert cli.main(args_for(target_dir, data_dir, old, "--max-steps", "5", "--resume")) == 2
    err = capsys.readouterr().err
    assert "--loss-gamma None -> 1.0" in err and "--block-bias 0.0 -> 4.0" in err
    assert cli.main(args_for(target_dir, data_dir, old, "--max-steps", "5", "--resume", "--loss-gamma", "dflash",
                             "--block-bias", "0")) == 0, capsys.readouterr().err


def test_each_training_step_runs_under_the_sdpa_choice(target_dir, data_dir, tmp_path, monkeypatch):
    """A step's context forward, rollout and backward run inside sdpa_backends(the run's device)
    (on a GPU: no cuDNN attention, which plans anew for every shape; dflow.attention)."""
    import contextlib

    import dflow.train.loop as loop

    seen, inside = [], [False]

    @contextlib.contextmanager
    def record(device):
        seen.append(device.type)
        inside[0] = True
        yield
        inside[0] = False

    forward, calls = Rollout.forward, []

    def checked(self, *args):
        calls.append(inside[0])
        return forward(self, *args)

    monkeypatch.setattr(loop, "sdpa_backends", record)
    monkeypatch.setattr(Rollout, "forward", checked)
    assert cli.main(args_for(target_dir, data_dir, tmp_path / "run", "--max-steps", "2", "--eval-samples", "0")) == 0
    assert seen == ["cpu", "cpu"] and calls == [True, True]


def test_extra_data_trains_on_more_but_holds_out_the_same(target_dir, data_dir, tmp_path, capsys):
    """--extra-data adds training sequences only: the held-out slice stays --data's, an extra
    sequence of a held-out conversation (same source id) is left out, and a resume must name the
    same folders."""
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    tok = AutoTokenizer.from_pretrained(target_dir)
    extra = write_data(tmp_path / "extra", model, tok, trajectories(model, 5, seed=1))  # source ids "0".."4"
    # --data's held-out: its last 2 of NUM_SEQS sequences, source ids "10" and "11"; make one extra id collide
    from dflow.data.shards import read_shard_metadata
    from dflow.train.dataset import load_train_data
    stats, _ = read_shard_metadata(extra / shard_name(0))
    write_shard(extra / shard_name(0), trajectories(model, 5, seed=1), id_dtype(model.config.vocab_size), stats,
                ["0", "1", "2", "3", "11"])
    data = load_train_data(str(data_dir), model, tok, 64, 2, extra=[str(extra)])
    plain = load_train_data(str(data_dir), model, tok, 64, 2)
    assert data.extra == 4 and len(data.train) == len(plain.train) + 4
    assert all(torch.equal(a[0], b[0]) for a, b in zip(data.held_out, plain.held_out))
    extra_ids = [torch.tensor(ids) for ids, _ in trajectories(model, 5, seed=1)]
    assert [t[0].tolist() for t in data.train[-4:]] == [x.tolist() for x in extra_ids[:4]]  # the "11" one is out

    out = tmp_path / "run"
    assert cli.main(args_for(target_dir, data_dir, out, "--max-steps", "2", "--rounds", "0",
                             "--extra-data", str(extra))) == 0
    assert f"{NUM_SEQS - 2 + 4} training sequences (4 from --extra-data), 2 held out" in capsys.readouterr().err
    assert cli.main(args_for(target_dir, data_dir, out, "--max-steps", "3", "--rounds", "0", "--resume")) == 2
    assert "--extra-data" in capsys.readouterr().err
    assert cli.main(args_for(target_dir, data_dir, out, "--max-steps", "3", "--rounds", "0", "--resume",
                             "--extra-data", str(extra))) == 0
    assert state_step(out) == 3
    assert cli.main(args_for(target_dir, data_dir, tmp_path / "self", "--max-steps", "1",
                             "--extra-data", str(data_dir))) == 2
    assert "is --data itself" in capsys.readouterr().err


def test_gpu_train_script_fills_its_budget_on_the_cpu(target_dir, data_dir, tmp_path):
    """scripts/gpu_train.sh's dry run (DEVICE=cpu): a calibration run inside the warmup, then a resume
    whose --max-steps the measured step time fits into the budget, FLAGS (here --extra-data) to both."""
    root = Path(__file__).resolve().parents[1]
    extra = write_data(tmp_path / "extra", AutoModelForCausalLM.from_pretrained(target_dir),
                       AutoTokenizer.from_pretrained(target_dir), trajectories(
                           AutoModelForCausalLM.from_pretrained(target_dir), 4, seed=2))
    out = tmp_path / "run"
    env = {**os.environ, "DEVICE": "cpu", "PY": sys.executable, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1",
           "OUT": str(out), "DATA": str(data_dir), "BUDGET": "50", "CAL": "2", "WARMUP": "3", "BATCH": "2",
           "RESERVE": "5"}
    flags = ["--target", str(target_dir), "--layers", "1", "--target-layers", "2", "--block-size", "8",
             "--anchors-per-seq", "4", "--max-len", "64", "--dtype", "float32", "--no-bf16", "--eval-samples", "2",
             "--eval-tokens", "4", "--extra-data", str(extra)]
    run = subprocess.run(["bash", str(root / "scripts" / "gpu_train.sh"), *flags], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "4 from --extra-data" in run.stderr
    fitted = int(run.stderr.split("--max-steps ")[-1].split()[0])
    assert fitted > 2  # a tiny step is fast: the budget holds many more than the calibration
    assert state_step(out) == fitted and max(losses(out)) == fitted
    assert json.loads((out / "checkpoint" / "train_state.json").read_text())["config"]["max_steps"] == fitted


def test_lease_branches_on_the_cpu(target_dir, data_dir, tmp_path):
    """scripts/lease/train.sh's branch calls, dry run (DEVICE=cpu): `branches` trains (c) DFlow for half
    its call, then (b) --no-relay for exactly (c)'s steps on (c)'s schedule; `branch-a` (a) k = 0 the
    same; each comes back in bf16 parts under the device tool's 8 files, which unpack.py joins."""
    root = Path(__file__).resolve().parents[1]
    tiny = ["--target", str(target_dir), "--layers", "1", "--target-layers", "2", "--block-size", "8",
            "--anchors-per-seq", "4", "--max-len", "64", "--dtype", "float32", "--no-bf16", "--eval-samples", "2",
            "--eval-tokens", "4"]
    lease, ret = tmp_path / "lease", tmp_path / "ret"
    (lease / "data").mkdir(parents=True)
    (lease / "data" / "d16k").symlink_to(data_dir)
    (lease / "data.path").write_text("data/d16k\n")
    env = {**os.environ, "DEVICE": "cpu", "PY": sys.executable, "OMP_NUM_THREADS": "1", "LEASE": str(lease),
           "CAL": "2", "WARMUP": "3", "BATCH": "2", "RESERVE": "5", "FLAGS": " ".join(tiny)}
    init = subprocess.run([sys.executable, "-m", "dflow.train", "--device", "cpu", "--data", str(data_dir),
                           "--out", str(lease / "init"), "--max-steps", "1", "--batch-size", "2", "--rounds", "0", "--no-progress", *tiny],
                          env={**env, "PYTHONPATH": str(root)}, capture_output=True, text=True, timeout=120)
    assert init.returncode == 0, init.stderr[-3000:]
    for mode, limit in (("branches", "130"), ("branch-a", "60")):
        ret.mkdir(exist_ok=True)
        run = subprocess.run(["bash", "scripts/lease/train.sh", mode, limit], cwd=root, env={**env, "OUT": str(ret)},
                             capture_output=True, text=True, timeout=200)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    sent = [p for p in ret.rglob("*") if p.is_file()]
    assert len(sent) <= 8 + 4 and all(p.stat().st_size < 16 * 2**20 for p in sent)  # two calls, at most 8 each
    c, b, a = (json.loads((lease / x / "checkpoint" / "train_state.json").read_text()) for x in "cba")
    assert c["step"] > 2 and b["step"] == a["step"] == c["step"]
    assert b["config"]["max_steps"] == a["config"]["max_steps"] == c["config"]["max_steps"]
    assert (c["config"]["rounds"], c["config"]["relay"]) == (2, True) and (b["config"]["rounds"], b["config"]["relay"]) == (2, False)
    assert a["config"]["rounds"] == 0 and c["config"]["init"] == b["config"]["init"] == a["config"]["init"]
    assert [r["lr"] for r in losses(lease / "b").values()] == [r["lr"] for r in losses(lease / "c").values()]
    unpack = subprocess.run([sys.executable, str(root / "scripts" / "lease" / "unpack.py"), str(ret), str(tmp_path / "got")],
                            capture_output=True, text=True, timeout=120)
    assert unpack.returncode == 0, unpack.stderr
    for x in "cba":
        got = load_drafter(tmp_path / "got" / x)
        assert (got.relay is not None) == (x == "c")  # (b) and (a) draft from plain masks


def test_layout_flag_sets_the_rollouts_layout(target_dir, data_dir, tmp_path):
    """--layout: auto leaves the rollout to pick by device (dense on CUDA), dense / chunked force it."""
    from dflow.train.sharding import Dist
    for layout, dense in (("auto", None), ("dense", True), ("chunked", False)):
        cfg = TrainConfig(target=str(target_dir), data=str(data_dir), out=str(tmp_path / layout), layout=layout,
                          max_steps=1, eval_samples=0, device="cpu")
        cfg.validate()
        assert Trainer(cfg, Dist.setup("cpu"), progress=False).rollout.dense is dense
    with pytest.raises(DFlowError, match="--layout must be one of auto, dense, chunked"):
        replace(cfg, layout="sparse").validate()
