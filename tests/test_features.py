"""The feature cache (`dflow features`, `dflow train --feature-cache`): the same loss as the live
target forward, foreign / stale / unfinished caches refused, an interrupted build resumed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import tiny_target
from dflow import cli
from dflow.errors import DFlowError
from dflow.data.shards import FORMAT, id_dtype, shard_name, target_identity, write_meta, write_shard
from dflow.train import features as features_module
from dflow.train import loop

PROMPT, REPLY = 5, 22


def write_two_shard_data(folder: Path, model, tokenizer, seed: int = 0) -> Path:
    """A `dflow data` folder of 2 shards x 6 sequences: the target's greedy replies to random prompts
    (prompts of varied length, so a batch needs padding; sequence 1 unsupervised, so the trainer skips
    it and its examples' indices differ from the folder's)."""
    gen = torch.Generator().manual_seed(seed)
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for k in range(2):
        seqs = []
        for i in range(6):
            prompt = torch.randint(4, model.config.vocab_size, (1, PROMPT + i % 3), generator=gen)
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=REPLY - 2 * (i % 2),
                                 do_sample=False, pad_token_id=0, eos_token_id=None)[0]
            reply = len(out) - prompt.shape[1] if (k, i) != (0, 1) else 0  # one with nothing to supervise
            seqs.append((out.tolist(), [False] * (len(out) - reply) + [True] * reply))
        write_shard(folder / shard_name(k), seqs, id_dtype(model.config.vocab_size), {}, [f"{k}-{i}" for i in range(6)])
        names.append(shard_name(k))
    write_meta(folder, {"format": FORMAT, "target": {"name": "tiny", **target_identity(model, tokenizer)},
                        "shards": names, "complete": True})
    return folder


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval(), AutoTokenizer.from_pretrained(tiny_target_dir)


@pytest.fixture
def data_dir(target, tmp_path):
    return write_two_shard_data(tmp_path / "data", *target)


def features_args(target_dir, data, out, *extra):
    return ["features", "--target", str(target_dir), "--data", str(data), "--out", str(out), "--target-layers", "2",
            "--store-dtype", "float32", "--batch-size", "4", "--no-progress", *extra]


def train_args(target_dir, data, out, *extra):
    return ["train", "--target", str(target_dir), "--data", str(data), "--out", str(out), "--layers", "2",
            "--target-layers", "2", "--block-size", "4", "--batch-size", "3", "--anchors-per-seq", "4", "--lr", "3e-3", "--max-steps", "3",
            "--eval-samples", "0", "--dtype", "float32", "--no-bf16", "--no-progress", *extra]


def step_losses(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def no_context_forward(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the target's context forward ran although the feature cache should serve it")
    monkeypatch.setattr(loop, "context_forward", refuse)


@pytest.mark.parametrize("extra", [["--rounds", "0"], ["--rounds", "2", "--no-relay", "--max-len", "20"]])
def test_cache_gives_the_same_loss_as_the_live_target_forward(extra, tiny_target_dir, data_dir, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    assert cli.main(features_args(tiny_target_dir, data_dir, cache)) == 0
    assert cli.main(train_args(tiny_target_dir, data_dir, tmp_path / "live", *extra)) == 0
    no_context_forward(monkeypatch)
    assert cli.main(train_args(tiny_target_dir, data_dir, tmp_path / "cached", *extra, "--feature-cache", str(cache))) == 0
    live, cached = step_losses(tmp_path / "live"), step_losses(tmp_path / "cached")
    assert len(live) == len(cached) == 3
    for a, b in zip(live, cached):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert [b[k] for k in b if k.startswith("acc_")] == [a[k] for k in a if k.startswith("acc_")]
        assert b["tokens"] == a["tokens"]


def test_a_bfloat16_cache_is_close_and_relay_rounds_still_run_the_target(tiny_target_dir, data_dir, tmp_path,
                                                                          monkeypatch, capsys):
    cache = tmp_path / "cache"
    assert cli.main(features_args(tiny_target_dir, data_dir, cache, "--store-dtype", "bfloat16")) == 0
    assert load_file(str(cache / shard_name(0)))["features"].dtype == torch.bfloat16
    assert cli.main(train_args(tiny_target_dir, data_dir, tmp_path / "live", "--rounds", "0")) == 0
    assert cli.main(train_args(tiny_target_dir, data_dir, tmp_path / "relay", "--rounds", "1",
                               "--feature-cache", str(cache))) == 0
    assert "relay rounds need the target's KV" in capsys.readouterr().err
    no_context_forward(monkeypatch)
    assert cli.main(train_args(tiny_target_dir, data_dir, tmp_path / "bf16", "--rounds", "0",
                               "--feature-cache", str(cache))) == 0
    for a, b in zip(step_losses(tmp_path / "live"), step_losses(tmp_path / "bf16")):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-2)


@pytest.mark.parametrize("case, message", [
    ("other_weights", "built for another target"),
    ("other_layers", "holds target layers [2]; this drafter reads [1, 1]"),
    ("other_dtype", "built with the target in float32, this run loads it in bfloat16"),
    ("stale", "is stale"),
    ("unfinished", "is unfinished (1 of 2 shards missing)"),
    ("not_a_cache", "is not a feature cache"),
])
def test_a_foreign_stale_or_unfinished_cache_is_refused(case, message, tiny_target_dir, target, data_dir, tmp_path,
                                                         capsys):
    cache, extra = tmp_path / "cache", []
    build = features_args(tiny_target_dir, data_dir, cache)
    if case == "other_weights":  # same architecture and vocabulary, other weights
        other = tmp_path / "other_target"
        tiny_target("llama", seed=1).save_pretrained(other)
        target[1].save_pretrained(other)
        build[2] = str(other)
    elif case == "other_layers":
        build[build.index("--target-layers") + 1] = "1"
    elif case == "other_dtype":
        extra = ["--dtype", "bfloat16"]
    assert cli.main(build) == 0
    if case == "stale":  # the data folder's shard 1 is rebuilt with other conversations
        other = write_two_shard_data(tmp_path / "other_data", *target, seed=1)
        (data_dir / shard_name(1)).write_bytes((other / shard_name(1)).read_bytes())
    elif case == "unfinished":
        (cache / shard_name(1)).unlink()
    elif case == "not_a_cache":
        (cache / "features.json").unlink()
    capsys.readouterr()
    assert cli.main(train_args(tiny_target_dir, data_dir, tmp_path / "out", "--rounds", "0", *extra,
                               "--feature-cache", str(cache))) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and message in err[-1] and "Traceback" not in "".join(err)
    if case in ("stale", "unfinished"):  # running `dflow features` again repairs it
        assert cli.main(build) == 0
        assert "1 of 2 shards done; building 1" in capsys.readouterr().err
        assert cli.main(train_args(tiny_target_dir, data_dir, tmp_path / "out", "--rounds", "0",
                                   "--feature-cache", str(cache))) == 0


def test_a_cache_folder_of_other_settings_is_not_overwritten(tiny_target_dir, data_dir, tmp_path, capsys):
    cache = tmp_path / "cache"
    assert cli.main(features_args(tiny_target_dir, data_dir, cache)) == 0
    assert cli.main(features_args(tiny_target_dir, data_dir, cache, "--last-state")) == 2
    assert "use another --out" in capsys.readouterr().err
    assert cli.main(features_args(tiny_target_dir, data_dir, cache, "--target-layers", "1")) == 2
    assert "holds target layers [1, 1]" in capsys.readouterr().err


def test_an_interrupted_build_resumes_at_the_missing_shard(target, data_dir, tmp_path, monkeypatch):
    model, tokenizer = target
    layer_ids = [1, 2]
    whole = features_module.build_features(model, tokenizer, data_dir, tmp_path / "whole", layer_ids,
                                           "float32", last_state=True, batch_size=6, progress=False)
    assert (whole["built"], whole["kept"]) == (2, 0)

    forward, calls = features_module.context_forward, []

    def interrupt_in_shard_1(model, ids, *args, **kwargs):  # batch_size 6: one forward per shard
        calls.append(ids.shape)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return forward(model, ids, *args, **kwargs)

    monkeypatch.setattr(features_module, "context_forward", interrupt_in_shard_1)
    cache = tmp_path / "cache"
    with pytest.raises(KeyboardInterrupt):
        features_module.build_features(model, tokenizer, data_dir, cache, layer_ids, "float32", last_state=True,
                                       batch_size=6, progress=False)
    assert sorted(p.name for p in cache.iterdir()) == ["features.json", shard_name(0)]  # no partial shard left
    calls.clear()
    resumed = features_module.build_features(model, tokenizer, data_dir, cache, layer_ids, "float32",
                                             last_state=True, batch_size=6, progress=False)
    assert (resumed["built"], resumed["kept"], len(calls)) == (1, 1, 1)
    for name in (shard_name(0), shard_name(1)):
        a, b = load_file(str(tmp_path / "whole" / name)), load_file(str(cache / name))
        assert a.keys() == b.keys() == {"features", "last", "offsets"}
        assert all(torch.equal(a[k], b[k]) for k in a)

    # the cache's rows are the target's own states: features = layers 1, 2; last = the final normed state
    opened = features_module.open_features(cache, data_dir, model, layer_ids)
    shard = load_file(str(data_dir / shard_name(1)))
    start, end = shard["offsets"][:2].tolist()
    ids = shard["input_ids"][start:end].long()[None]  # sequence 6 = shard 1's first
    out = model(input_ids=ids, output_hidden_states=True)
    assert opened.spans[6] == (1, 0, end - start)
    torch.testing.assert_close(opened.features(6), torch.cat([out.hidden_states[2], out.hidden_states[3]], -1)[0])
    torch.testing.assert_close(model.lm_head(opened.last(6)), out.logits[0])


def test_kl_loss_from_a_last_state_cache_equals_the_live_one_and_a_plain_cache_is_refused(
        tiny_target_dir, data_dir, tmp_path, monkeypatch, capsys):
    """`--loss kl` reads the target's final states: live (one more layer output of the context
    forward) and from a `--last-state` cache give the same losses, unlike `--loss ce`'s; a cache
    without them is one clear error."""
    cache, plain = tmp_path / "cache", tmp_path / "plain"
    assert cli.main(features_args(tiny_target_dir, data_dir, cache, "--last-state")) == 0
    assert cli.main(features_args(tiny_target_dir, data_dir, plain)) == 0
    kl = ["--rounds", "0", "--loss", "kl"]
    assert cli.main(train_args(tiny_target_dir, data_dir, tmp_path / "ce", "--rounds", "0")) == 0
    assert cli.main(train_args(tiny_target_dir, data_dir, tmp_path / "live", *kl)) == 0
    capsys.readouterr()
    assert cli.main(train_args(tiny_target_dir, data_dir, tmp_path / "refused", *kl, "--feature-cache", str(plain))) != 0
    assert "--loss kl reads the target's final states" in capsys.readouterr().err
    no_context_forward(monkeypatch)
    assert cli.main(train_args(tiny_target_dir, data_dir, tmp_path / "cached", *kl, "--feature-cache", str(cache))) == 0
    ce, live, cached = (step_losses(tmp_path / n) for n in ("ce", "live", "cached"))
    for a, b, c in zip(live, cached, ce):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert a["loss"] != pytest.approx(c["loss"], rel=1e-3)


def test_float8_rows_keep_each_value_to_e4m3_precision_of_its_rows_scale():
    """One scale per token and layer: a row's largest magnitude maps to 448, every value comes back
    within e4m3's rounding (a 16th of itself, or a 512th of the scale near zero), zero rows stay zero."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 2 * 8, generator=gen)  # [b, T, 2 layers x 8]
    x[0, 0, 3] = 900.0  # a massive activation in layer 0 of one token
    x[1, 2] = 0.0
    q, scale = features_module.quantize_fp8(x, 2)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and scale.shape == (3, 5, 2)
    torch.testing.assert_close(scale, x.unflatten(-1, (2, 8)).abs().amax(-1) / 448)
    back = features_module.dequantize_fp8(q, scale)
    bound = x.abs() / 16 + scale.repeat_interleave(8, -1) / 512 + 1e-30
    assert back.dtype == torch.float32 and bool(((back - x).abs() <= bound).all())
    assert torch.equal(back[1, 2], torch.zeros(16))
    assert back[0, 0, 3] == 900.0  # the row's maximum is exact
    assert float((back[0, 0, 8:] - x[0, 0, 8:]).abs().max()) < 0.1  # layer 1 keeps its own, finer scale


def test_a_float8_cache_is_half_the_size_and_trains_as_the_live_forward(tiny_target_dir, data_dir, tmp_path,
                                                                          monkeypatch, capsys):
    """`--store-dtype float8`: e4m3 rows + float32 scales (features and last state), read back as
    float32 close to the target's own states; a run on it follows the live run's losses (as bfloat16's)."""
    bf16, fp8 = tmp_path / "bf16", tmp_path / "fp8"
    assert cli.main(features_args(tiny_target_dir, data_dir, bf16, "--store-dtype", "bfloat16", "--last-state")) == 0
    assert cli.main(features_args(tiny_target_dir, data_dir, fp8, "--store-dtype", "float8", "--last-state")) == 0
    shard = load_file(str(fp8 / shard_name(0)))
    tokens = len(load_file(str(data_dir / shard_name(0)))["input_ids"])
    assert shard["features"].dtype == shard["last"].dtype == torch.float8_e4m3fn
    assert shard["features_scale"].shape == (tokens, 2) and shard["last_scale"].shape == (tokens, 1)
    hidden = shard["last"].shape[1]
    assert (3 * tokens * (hidden + 4)) == sum(t.numel() * t.element_size() for k, t in shard.items() if k != "offsets")
    assert "GB; layers" in capsys.readouterr().err

    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    layer_ids = json.loads((bf16 / "features.json").read_text())["layer_ids"]
    exact = features_module.open_features(bf16, data_dir, model, layer_ids)
    rounded = features_module.open_features(fp8, data_dir, model, layer_ids)
    batch = rounded.batch([0, 6], [20, 12], last=True)
    assert batch.dtype == torch.float32 and batch.shape[:2] == (2, 20)
    torch.testing.assert_close(batch, exact.batch([0, 6], [20, 12], last=True).float(), rtol=0.07, atol=0.02)

    assert cli.main(train_args(tiny_target_dir, data_dir, tmp_path / "live", "--rounds", "0")) == 0
    no_context_forward(monkeypatch)
    assert cli.main(train_args(tiny_target_dir, data_dir, tmp_path / "cached", "--rounds", "0",
                               "--feature-cache", str(fp8))) == 0
    for a, b in zip(step_losses(tmp_path / "live"), step_losses(tmp_path / "cached")):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-2)


def test_an_unknown_store_dtype_is_refused(tiny_target_dir, data_dir, tmp_path, target, capsys):
    with pytest.raises(DFlowError, match="--store-dtype must be one of float32, bfloat16, float8, got int8"):
        features_module.build_features(*target, data_dir, tmp_path / "c", [1, 2], "int8", progress=False)
    with pytest.raises(SystemExit) as exit_:
        cli.main(features_args(tiny_target_dir, data_dir, tmp_path / "c", "--store-dtype", "int8"))
    assert exit_.value.code == 2 and "invalid choice: 'int8'" in capsys.readouterr().err


def test_a_live_run_resumed_on_two_processes_from_the_cache_goes_on_as_before(tiny_target_dir, data_dir, tmp_path):
    """What 2k3 does: a run checkpointed by one process with the live target forward resumes under torchrun
    (2 processes, each reading its own sequences' rows) with --feature-cache (float32: exact) and goes on as
    the uninterrupted live run (losses to 1e-5 relative: the float sums differ in order)."""
    cache, ref, out = tmp_path / "cache", tmp_path / "ref", tmp_path / "run"
    assert cli.main(features_args(tiny_target_dir, data_dir, cache)) == 0
    common = ["--rounds", "0", "--max-steps", "3", "--batch-size", "4"]
    assert cli.main(train_args(tiny_target_dir, data_dir, ref, *common)) == 0
    assert cli.main(train_args(tiny_target_dir, data_dir, out, *common, "--stop-at", "1")) == 0
    args = train_args(tiny_target_dir, data_dir, out, *common, "--feature-cache", str(cache), "--resume")[1:]
    args[len(args) - 1 - args[::-1].index("--batch-size") + 1] = "2"  # the last --batch-size: 2 x 2 processes
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          "-m", "dflow.train", *args], env={**os.environ, "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    a, b = step_losses(ref), step_losses(out)
    assert [r["step"] for r in b] == [1, 2, 3]
    for x, y in zip(a[1:], b[1:]):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5) and y["tokens"] == x["tokens"]
