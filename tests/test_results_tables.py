"""scripts/results_tables.py: issue 14's bars read the right figures (tokens/s ratios, not the
decode-time speedup) and call each met or missed."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

spec = importlib.util.spec_from_file_location("results_tables",
                                              Path(__file__).parents[1] / "scripts" / "results_tables.py")
rt = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rt)


def cell(tau: float, tok_s: float, speedup: float = 1.0) -> dict:
    return {"tau": tau, "tokens_per_s": tok_s, "speedup": speedup}


def results(dflow_tok_s: float, relay_off_tau: float) -> dict:
    res = {}
    for d in ("humaneval", "gsm8k", "mt-bench"):
        res[d] = {"ar": cell(1.0, 10.0), "pld": cell(1.5, 14.0), "dflash": cell(2.1, 15.0),
                  "dflow-relay-off": cell(relay_off_tau, 15.0), "dflow": cell(2.3, dflow_tok_s, speedup=0.9)}
    res["overall"] = {m: dict(res["gsm8k"][m]) for m in res["gsm8k"]}
    return res


def test_bars_met_on_tokens_per_s_even_when_the_time_speedup_is_low():
    lines = rt.bars(results(dflow_tok_s=14.5, relay_off_tau=2.2))
    text = "\n".join(lines)
    assert "MISSED" not in text, text
    assert "humaneval 1.45x" in text and "**1.04x** pld" in text and "**1.095**" in text


def test_bars_missed_each_on_its_own_figure():
    lines = rt.bars(results(dflow_tok_s=13.9, relay_off_tau=2.4))
    missed = [line for line in lines if "MISSED" in line]
    assert len(missed) == 3  # 1.39x ar, below pld on HumanEval, relay off above on
    assert any("1.4x ar" in line for line in missed) and any("pld" in line for line in missed)
    assert any("relay on > off" in line for line in missed)
    assert "(met)" in next(line for line in lines if "overall tau" in line)


def test_train_cost_counts_a_resumed_step_once(tmp_path):
    step = {"loss": 1.0, "tokens": 100, "tokens_per_s": 10.0, "acc_r0": 0.3, "cpu_s": 1800.0, "anchors_r0": 50}
    recs = [dict(step, step=1), dict(step, step=2), dict(step, step=2), {"eval_tau": 1.5}]  # step 2 redone
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs))
    row = rt.train_cost([f"x={tmp_path}"]).splitlines()[-1].split(" | ")
    assert row[2:6] == ["2", "0.3", "1.00", "100"]  # steps, step minutes, core-hours, round-0 blocks
