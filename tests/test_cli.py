"""`dflow generate` / `dflow init-drafter`: JSON output, streaming, and one-line errors on bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import tiny_target
from dflow.cli import main
from dflow.model import DFlowDrafter, config_for_target, load_drafter, save_drafter

PROMPT = "w5 w9 w12 w3"


def run_json(capsys, *argv):
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_json_same_tokens_for_every_method(tiny_target_dir, drafter_dir, capsys):
    common = ["generate", PROMPT, "--target", str(tiny_target_dir), "--drafter", str(drafter_dir),
              "--dtype", "float32", "--max-new-tokens", "12", "--json"]
    outs = {m: run_json(capsys, *common, "--method", m) for m in ("ar", "dflash", "dflow")}
    for out in outs.values():
        assert {"text", "token_ids", "num_new_tokens", "rounds", "tau", "accepted", "decode_s",
                "tokens_per_s"} <= set(out)
        assert out["token_ids"] == outs["ar"]["token_ids"]
        assert out["num_new_tokens"] == len(out["token_ids"]) and len(out["accepted"]) == out["rounds"]
    no_chat = run_json(capsys, *common, "--method", "ar", "--no-chat")
    assert no_chat["token_ids"] != outs["ar"]["token_ids"] or no_chat["text"] is not None


def test_generate_streams_text_and_prints_tau(tiny_target_dir, drafter_dir, capsys):
    assert main(["generate", PROMPT, "--target", str(tiny_target_dir), "--drafter", str(drafter_dir),
                 "--max-new-tokens", "6"]) == 0
    captured = capsys.readouterr()
    assert "tau" in captured.err and "tokens/s" in captured.err


@pytest.mark.parametrize("argv, message", [
    (["--target", "no-such-alias"], "unknown target"),
    (["--target", "/no/such/folder"], "unknown target"),
    (["--prompt", "   "], "empty"),
    (["--prompt", " ".join(["w7"] * 600)], "context"),
    (["--prompt", "w5 \udcff\udcfe w6"], "not valid UTF-8 text: character 3 (byte 0xff)"),
    (["--block-size", "1"], "block-size"),
    (["--block-size", "65"], "block-size"),
    (["--temperature", "-1"], "temperature"),
])
def test_bad_input_is_one_line_and_exit_2(tiny_target_dir, drafter_dir, capsys, argv, message):
    args = {"--target": str(tiny_target_dir), "--prompt": PROMPT}
    rest = []
    it = iter(argv)
    for a in it:
        if a in args:
            args[a] = next(it)
        else:
            rest += [a, next(it)]
    code = main(["generate", args["--prompt"], "--target", args["--target"], "--drafter", str(drafter_dir),
                 "--max-new-tokens", "4", *rest])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error:") and message in err[0], err


def test_bad_drafters_are_one_line_errors(tiny_target_dir, drafter_dir, tmp_path, capsys):
    other, wide = tmp_path / "other", tmp_path / "wide"
    save_drafter(DFlowDrafter(config_for_target(tiny_target("llama", vocab=80).config, 2, 4)).init_weights(), other)
    wide_target = tiny_target("llama").config
    wide_target.hidden_size = 48
    save_drafter(DFlowDrafter(config_for_target(wide_target, 2, 4)).init_weights(), wide)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "pytorch_model.bin").write_bytes(b"not even a pickle")
    corrupt = tmp_path / "corrupt"
    shutil.copytree(drafter_dir, corrupt)
    (corrupt / "model.safetensors").write_bytes(b"\x01\x02")
    typed = tmp_path / "typed"
    shutil.copytree(drafter_dir, typed)
    config = json.loads((typed / "config.json").read_text())
    (typed / "config.json").write_text(json.dumps({**config, "num_hidden_layers": "two"}))
    for path, message in [(other, "vocabulary"), (wide, "hidden size 48 != target's 32"), (pickled, "pickle"),
                          (corrupt, "corrupted"),
                          (typed, "num_hidden_layers must be an integer"), (tmp_path / "nope", "does not exist")]:
        code = main(["generate", PROMPT, "--target", str(tiny_target_dir), "--drafter", str(path)])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and message in err[0], err


def _init(target_dir, out, seed="0"):
    return main(["init-drafter", "--target", str(target_dir), "--layers", "1", "--block-size", "4", "--seed", seed,
                 "--out", str(out)])


@pytest.mark.parametrize("argv, message", [
    (["--block-size", "1"], "--block-size must be in 2..64"),
    (["--block-size", "65"], "--block-size must be in 2..64"),
    (["--layers", "0"], "--layers must be >= 1"),
    (["--target", "/no/such/folder"], "unknown target"),
])
def test_init_drafter_bad_input_is_one_line(tiny_target_dir, tmp_path, capsys, argv, message):
    assert main(["init-drafter", "--target", str(tiny_target_dir), "--out", str(tmp_path / "d"), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and message in err[0], err
    assert not (tmp_path / "d").exists()


def test_init_drafter_never_deletes_what_it_did_not_write(tiny_target_dir, tmp_path, capsys):
    """A non-empty folder that is no drafter (a user's file, a subfolder) and a file are refused
    with one line; nothing in them changes and nothing is written beside them."""
    notes, nested, file = tmp_path / "notes", tmp_path / "nested", tmp_path / "file"
    notes.mkdir()
    (notes / "notes.txt").write_text("mine")
    (nested / "sub").mkdir(parents=True)
    (nested / "sub" / "x.txt").write_text("mine")
    file.write_text("mine")
    for out, message in [(notes, "holds no drafter"), (nested, "holds no drafter"), (file, "is a file"),
                         (file / "d", "is a file")]:
        assert _init(tiny_target_dir, out) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error:") and message in err[0], err
    assert [p.name for p in notes.iterdir()] == ["notes.txt"] and (notes / "notes.txt").read_text() == "mine"
    assert [p.name for p in nested.iterdir()] == ["sub"] and (nested / "sub" / "x.txt").read_text() == "mine"
    assert file.read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "nested", "notes"]


def test_init_drafter_replaces_a_drafter_in_place(tiny_target_dir, tmp_path, monkeypatch):
    """A new folder or an empty one gets a drafter; a drafter folder gets its two files replaced
    (other files kept, no temporaries left, nothing written beside it); a save that fails midway
    leaves the previous drafter whole."""
    from dflow import model as model_module

    empty = tmp_path / "empty"
    empty.mkdir()
    assert _init(tiny_target_dir, empty) == 0 and load_drafter(empty).cfg.num_hidden_layers == 1
    out = tmp_path / "new" / "d"
    assert _init(tiny_target_dir, out, seed="1") == 0
    (out / "notes.txt").write_text("mine")
    first = load_drafter(out).state_dict()
    assert _init(tiny_target_dir, out, seed="2") == 0
    second = load_drafter(out).state_dict()
    assert not all(torch.equal(first[k], second[k]) for k in first)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "notes.txt"]
    assert (out / "notes.txt").read_text() == "mine" and [p.name for p in out.parent.iterdir()] == ["d"]

    def interrupted(tensors, path, metadata=None):
        Path(path).write_bytes(b"half a file")
        raise KeyboardInterrupt
    monkeypatch.setattr(model_module, "save_file", interrupted)
    assert _init(tiny_target_dir, out, seed="3") == 130
    kept = load_drafter(out).state_dict()
    assert all(torch.equal(kept[k], second[k]) for k in kept)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "notes.txt"]
    assert _init(tiny_target_dir, tmp_path / "fresh", seed="3") == 130 and not (tmp_path / "fresh").exists()


def test_prompts_that_are_not_utf8_are_refused_in_every_form(tiny_target_dir):
    from dflow.errors import DFlowError
    from dflow.pipeline import Pipeline

    pipe = Pipeline.load(str(tiny_target_dir), need_drafter=False)
    bad = "w5 \udcff w6"  # what os.fsdecode makes of the byte 0xff in argv
    for prompt, chat in [(bad, True), (bad, False), ([{"role": "user", "content": bad}], True)]:
        with pytest.raises(DFlowError, match="not valid UTF-8"):
            pipe.encode(prompt, chat)
    assert pipe.encode("w5 w6", False)  # valid text still encodes


@pytest.mark.parametrize("argv, where", [
    (["generate", PROMPT], "dflow.pipeline.Pipeline.load"),
    (["init-drafter", "--out", "OUT"], "dflow.commands.generate.load_target"),
    (["data", "--out", "OUT"], "dflow.commands.data.build_dataset"),
    (["train", "--data", "OUT", "--out", "OUT"], "dflow.commands.train.train"),
    (["bench", "--out", "OUT", "--datasets", "gsm8k", "--target", "TARGET", "--drafter", "DRAFTER"],
     "dflow.commands.bench.run_bench"),
])
def test_ctrl_c_exits_130_in_every_command(tiny_target_dir, drafter_dir, tmp_path, capsys, monkeypatch, argv, where):
    """One SIGINT convention (128 + 2, as shells report it), wherever the interruption comes."""
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(where, interrupted)
    paths = {"OUT": tmp_path / "out", "TARGET": tiny_target_dir, "DRAFTER": drafter_dir}
    assert main([str(paths.get(a, a)) for a in argv]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("interrupted")
