"""`dflow generate` / `dflow init-drafter`: JSON output, streaming, and one-line errors on bad input."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import tiny_target
from dflow.cli import main
from dflow.model import DFlowDrafter, config_for_target, save_drafter

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
    (["--prompt", "   "], "empty"),
    (["--prompt", " ".join(["w7"] * 600)], "context"),
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
    other = tmp_path / "other"
    save_drafter(DFlowDrafter(config_for_target(tiny_target("llama", vocab=80).config, 2, 4)).init_weights(), other)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "pytorch_model.bin").write_bytes(b"not even a pickle")
    corrupt = tmp_path / "corrupt"
    shutil.copytree(drafter_dir, corrupt)
    (corrupt / "model.safetensors").write_bytes(b"\x01\x02")
    for path, message in [(other, "vocabulary"), (pickled, "pickle"), (corrupt, "corrupted"),
                          (tmp_path / "nope", "does not exist")]:
        code = main(["generate", PROMPT, "--target", str(tiny_target_dir), "--drafter", str(path)])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and message in err[0], err
