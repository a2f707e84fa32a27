"""The report writer: overall averages, results.json, report.md and the PNG plots."""

import json
import math

import pytest

from dflow.report import add_overall, format_runtime_breakdown, write_report


def cell(tau, speedup, tok_s, accept, mismatches=0, relay=0.0):
    return {
        "tau": tau,
        "tau_per_sample": tau,
        "tokens_per_s": tok_s,
        "speedup": speedup,
        "accept_by_position": accept,
        "accepted_histogram": [1, 2, 3, 4],
        "time_split_ms": {
            "draft": 2.0, "relay": relay, "verify": 7.0, "bookkeeping": 1.0, "total": 10.0 + relay
        },
        "mismatches": mismatches,
        "num_prompts": 2,
        "num_tokens": 100,
        "prefill_s": 0.5,
    }


NAN3 = [math.nan] * 3
RESULTS = {
    "gsm8k": {
        "ar": cell(1.0, 1.0, 20.0, NAN3),
        "dflash": cell(3.0, 2.0, 40.0, [0.8, 0.6, 0.4]),
        "dflow": cell(4.0, 2.5, 50.0, [0.9, 0.7, 0.5], relay=0.5),
    },
    "humaneval": {
        "ar": cell(1.0, 1.0, 22.0, NAN3),
        "dflash": cell(2.0, 1.5, 33.0, [0.6, 0.4, 0.2], mismatches=1),
        "dflow": cell(3.0, 2.0, 44.0, [0.7, 0.5, 0.3], relay=0.5),
    },
}
OFFLINE = "no --data-file given and the `datasets` hub loader is not installed (offline)"
SKIPPED = {"mbpp": f"mbpp: {OFFLINE}"}
META = {
    "command": "dflow bench --datasets gsm8k humaneval mbpp",
    "dtype": "bfloat16",
    "versions": {"torch": "2.13.0"},
}


def test_add_overall_is_a_plain_mean_over_datasets():
    overall = add_overall(RESULTS)["overall"]
    assert overall["dflow"]["tau"] == pytest.approx(3.5)
    assert overall["dflow"]["speedup"] == pytest.approx(2.25)
    assert overall["dflash"]["tokens_per_s"] == pytest.approx(36.5)
    assert overall["dflash"]["mismatches"] == 1 and overall["dflash"]["num_prompts"] == 4
    assert overall["dflow"]["accept_by_position"] == pytest.approx([0.8, 0.6, 0.4])
    assert overall["dflow"]["accepted_histogram"] == [2, 4, 6, 8]
    assert overall["dflow"]["time_split_ms"]["relay"] == pytest.approx(0.5)
    assert overall["ar"]["datasets"] == ["gsm8k", "humaneval"]
    assert "overall" not in RESULTS  # the input is left alone


def test_format_runtime_breakdown():
    split = {"draft": 2.0, "relay": 0.0, "verify": 7.0, "bookkeeping": 1.0}
    text = format_runtime_breakdown({"dflash": split})
    header, row = text.splitlines()
    assert header.split()[0] == "method" and "relay ms (%)" in header
    assert "2.00 (20.0%)" in row and "7.00 (70.0%)" in row and row.endswith("10.00")


def test_write_report(tmp_path):
    paths = write_report(tmp_path / "run", RESULTS, SKIPPED, META)
    assert set(paths) == {"json", "markdown", "tau_plot", "acceptance_plot", "speedup_plot"}
    for key in ("tau_plot", "acceptance_plot", "speedup_plot"):
        assert paths[key].suffix == ".png" and paths[key].stat().st_size > 1000
        assert paths[key].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    saved = json.loads(paths["json"].read_text())  # strict JSON: nan became null
    assert saved["skipped"] == SKIPPED and saved["meta"]["dtype"] == "bfloat16"
    assert saved["results"]["overall"]["dflow"]["tau"] == pytest.approx(3.5)
    assert saved["results"]["gsm8k"]["ar"]["accept_by_position"] == [None, None, None]

    md = paths["markdown"].read_text()
    assert "| method | gsm8k | humaneval | overall |" in md
    assert "| dflow | 4.00 / 2.50x | 3.00 / 2.00x | 3.50 / 2.25x |" in md
    acceptance = md.split("## Acceptance rate by draft position")[1].split("##")[0]
    assert "| method | d1 | d2 | d3 |" in acceptance and "| dflash | 70.0% | 50.0% | 30.0% |" in acceptance
    assert "| ar |" not in acceptance  # nothing drafted, no row
    assert "- dflash: mismatches = 1 (4 prompts)" in md
    assert "## Skipped datasets" in md and f"- mbpp: {OFFLINE}" in md
    assert "relay ms (%)" in md and "tau_per_dataset.png" in md


def test_write_report_with_everything_skipped(tmp_path):
    paths = write_report(tmp_path, {}, SKIPPED, META)
    assert "No method drafted tokens." in paths["markdown"].read_text()
    assert all(p.exists() for p in paths.values())
