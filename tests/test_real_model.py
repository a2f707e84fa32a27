"""A few checks on the real default target (marked `real`; the first run converts the GGUF once)."""

from __future__ import annotations

import os

import pytest
import torch

from dflow.datasets import load_dataset
from dflow.engine import generate
from dflow.pipeline import Pipeline
from dflow.proposers import OracleProposer

pytestmark = pytest.mark.real
MAX_NEW = 48


@pytest.fixture(scope="module")
def pipe32():
    threads = torch.get_num_threads()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    yield Pipeline.load("smollm2-135m", dtype="float32")
    torch.set_num_threads(threads)


def test_default_target_is_lossless_in_float32_on_humaneval(pipe32):
    """Every method (and the oracle: real multi-token verification) == HF greedy, 5 HumanEval prompts."""
    for sample in load_dataset("humaneval", 5):
        ids = pipe32.encode(sample.turns[0])
        x = torch.tensor([ids])
        ref = pipe32.target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW, do_sample=False,
                                     eos_token_id=pipe32.stop_token_ids)[0, len(ids):].tolist()
        for method in ("ar", "dflash", "dflow"):
            assert pipe32.generate(ids, method, MAX_NEW).token_ids == ref, (sample.id, method)
        r = generate(pipe32.target, ids, proposer=OracleProposer(ids + ref, pipe32.target.config.vocab_size),
                     block_size=16, max_new_tokens=MAX_NEW, stop_token_ids=pipe32.stop_token_ids)
        assert r.token_ids == ref, (sample.id, "oracle")
        assert all(x.accepted == 15 for x in r.rounds[:-1])


def test_the_shipped_drafter_is_the_default_and_drafts_something(pipe32):
    """With no --drafter, the alias loads the trained DFlow drafter shipped in the package (bf16
    on disk, relay on, block 4: the fastest block on the EPYC, results/blocks-2j), not a fresh one; the
    loop above already ran it losslessly. Trained (HumanEval tau about 1.7 in results/blocks-2j),
    it accepts well over 0.3 drafts a round on a HumanEval prompt, where a fresh drafter accepts
    essentially none."""
    assert not pipe32.fresh_drafter and "assets/drafters/smollm2-135m" in pipe32.drafter_note
    assert pipe32.drafter.relay is not None and pipe32.drafter.cfg.block_size == 4
    ids = pipe32.encode(load_dataset("humaneval", 1)[0].turns[0])
    accepted = pipe32.generate(ids, "dflow", 64).accepted
    assert sum(accepted) / len(accepted) > 0.3, accepted
