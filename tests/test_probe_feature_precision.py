"""scripts/probe_feature_precision.py: the drafter's statistics on rounded features, on a tiny target."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

from conftest import tiny_target, training_examples
from dflow.pipeline import init_drafter

spec = importlib.util.spec_from_file_location("probe_feature_precision",
                                              Path(__file__).parents[1] / "scripts" / "probe_feature_precision.py")
probe = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = probe
spec.loader.exec_module(probe)


def test_exact_features_score_as_themselves_and_rounded_ones_close_by():
    torch.manual_seed(0)
    target = tiny_target("llama")
    drafter = init_drafter(target, layers=2, block_size=4, relay=False).eval()
    data = training_examples()
    rows = probe.probe(target, drafter, data, sequences=4, batch_size=2, anchors=8, seed=0)
    shape = rows.pop("rows")
    assert 1 < shape["absmax_over_rms_median"] < 32 ** 0.5 and 4 / 32 < shape["top4_share_median"] < 1  # hidden 32
    exact, bf16 = rows["float32"], rows["bfloat16"]
    fp8, int8 = rows["float8 e4m3 (scale per token, layer)"], rows["int8 (absmax per token, layer)"]
    assert exact["rel_error"] == 0 and exact["blocks"] == 32
    # bfloat16 keeps 8 bits of mantissa, e4m3 4; int8's uniform grid does well on a random target's even rows
    # (SmolLM2's massive activations are what sink it there: docs/training.md "A float8 feature cache")
    assert 0 < bf16["rel_error"] < fp8["rel_error"] < 0.1 and 0 < int8["rel_error"] < 0.1
    assert all(r["blocks"] == 32 for r in rows.values())  # the same blocks scored in every format
    assert abs(fp8["loss"] - exact["loss"]) < 0.05 * exact["loss"]
    assert {**rows, "rows": shape} == probe.probe(target, drafter, data, sequences=4, batch_size=2, anchors=8,
                                                  seed=0)  # seeded
