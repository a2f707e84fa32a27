"""`dflow data --engine vllm` (needs the vllm extra; skipped without it): its shards load through
`dflow train`'s reader, an interrupted build resumes into the shards of an uninterrupted one, the
stored sequence is the template pieces plus vLLM's own generated ids, and a refused start is one
line. One engine serves the whole module (a start costs about a minute)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from transformers import AutoTokenizer

pytest.importorskip("vllm", reason="needs the vllm extra (make vllm)")
pytestmark = pytest.mark.vllm

from conftest import vllm_tiny_llama  # noqa: E402
from test_data import RECORDS, spans, write_sharegpt  # noqa: E402
from dflow.data import DataConfig, build_dataset  # noqa: E402
from dflow.data.plan import plan  # noqa: E402
from dflow.data.regenerate import Trajectory, Turns  # noqa: E402
from dflow.data.shards import shard_name  # noqa: E402
from dflow.data.vllm_engine import shutdown, start_engine  # noqa: E402
from dflow.errors import DFlowError  # noqa: E402
from dflow.targets import resolve_target  # noqa: E402
from dflow.train.dataset import load_train_data  # noqa: E402

MAX_NEW = 12


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny random Llama vLLM runs (head size 32) with SmolLM2's tokenizer and chat template; its
    <|im_end|> row is scaled so that some replies end within MAX_NEW tokens and others are cut."""
    root = tmp_path_factory.mktemp("vllm_data")
    model = vllm_tiny_llama(root, vocab=49152, layers=2)
    with torch.no_grad():
        model.lm_head.weight[2] *= 3.0
    model.generation_config.eos_token_id = 2
    model.save_pretrained(root / "target")
    AutoTokenizer.from_pretrained(resolve_target("smollm2-135m")).save_pretrained(root / "target")
    return root


def config(root, **kw):
    base = dict(target=str(root / "target"), num_conversations=5, max_len=96, max_new_tokens=MAX_NEW,
                dtype="float32", shard_size=2, batch_size=4, sharegpt=str(root / "sharegpt.json"), engine="vllm",
                kv_cache_gib=1)
    return DataConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def llm(target):
    write_sharegpt(target / "sharegpt.json", RECORDS)
    engine = start_engine(str(target / "target"), config(target))
    yield engine
    shutdown(engine)


def shards(folder):
    return {p.name: load_file(p) for p in sorted(folder.glob("shard-*"))}


def test_vllm_shards_load_resume_and_round_trip(target, llm, tmp_path, monkeypatch):
    cfg = config(target)
    whole = build_dataset(cfg, tmp_path / "whole", progress=False, llm=llm)
    assert whole["complete"] and whole["engine"]["name"] == "vllm" and whole["engine"]["version"]
    assert whole["settings"]["engine"] == "vllm" and whole["counts"]["conversations"] == 5
    assert whole["wall_s"] > 0 and whole["generated_tokens_per_s"] > 0

    # 1. interrupted (as by Ctrl-C) when its second shard is done, then resumed by the same command
    from dflow.data import build

    write, writes = build.write_shard, []

    def interrupt_second(path, *a, **k):
        writes.append(path.name)
        if len(writes) == 2:
            raise KeyboardInterrupt
        return write(path, *a, **k)

    monkeypatch.setattr(build, "write_shard", interrupt_second)
    with pytest.raises(KeyboardInterrupt):
        build_dataset(cfg, tmp_path / "resumed", progress=False, llm=llm)
    assert sorted(p.name for p in (tmp_path / "resumed").glob("shard-*")) == writes[:1]
    monkeypatch.setattr(build, "write_shard", write)
    resumed = build_dataset(cfg, tmp_path / "resumed", progress=False, llm=llm)
    assert resumed["complete"] and resumed["counts"] == whole["counts"]
    a, b = shards(tmp_path / "whole"), shards(tmp_path / "resumed")
    assert a.keys() == b.keys() and all(np.array_equal(a[n][k], b[n][k]) for n in a for k in a[n])

    # 2. the shards load through `dflow train`'s reader, checked against the target
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target / "target", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(target / "target")
    data = load_train_data(str(tmp_path / "whole"), model, tokenizer, max_len=96, held_out=1)
    assert len(data.train) + len(data.held_out) == 5

    # 3. round trip: prompt spans are the template pieces tokenized, reply spans vLLM's own greedy ids
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    planned, _ = plan(cfg, tokenizer, target / "sharegpt.json")
    turns = Turns(tokenizer, {2}, cfg.max_len, cfg.max_new_tokens)
    from dflow.data.shards import open_dataset

    ds = open_dataset(tmp_path / "whole")
    ended = cut = 0
    for conv, (ids, mask) in zip(planned, ds):
        ids, mask = ids.tolist(), mask.tolist()
        t = Trajectory(conv.pieces)
        for start, end in spans(mask):
            assert turns.add_prompt(t) and t.ids == ids[:start]  # the template piece, tokenized
            prompt = TokensPrompt(prompt_token_ids=ids[:start])
            again = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=turns.cap(t), stop_token_ids=[2],
                                                          detokenize=False), use_tqdm=False)[0].outputs[0]
            reply = ids[start:end]
            assert list(again.token_ids) == reply  # the generated ids, never re-tokenized
            turns.add_reply(t, reply)
            ended += reply[-1] == 2
            cut += reply[-1] != 2
        assert t.ids == ids
    assert ended and cut  # both paths ran: replies that end with <|im_end|> and replies cut at MAX_NEW


def test_vllm_refusing_to_start_is_one_line(target, monkeypatch):
    """With the KV cache sized from --memory-fraction, vLLM checks that share of memory is free."""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    with pytest.raises(DFlowError, match="vLLM could not start.*--memory-fraction") as e:
        start_engine(str(target / "target"), config(target, memory_fraction=1.0, kv_cache_gib=None))
    assert "\n" not in str(e.value)


def test_sampled_replies_run_whole_prefills(target, llm, tmp_path, monkeypatch):
    """--temperature > 0: requests carry seeds, and on the CPU vLLM 0.32 cannot rewind a seeded
    request's generator after a chunked prefill ("CPU Generator does not use offset"), so the
    engine starts with whole prefills and room for the longest prompt; the sampled build runs."""
    import vllm

    seen = {}

    class Fake:
        def __init__(self, **kwargs):
            seen.update(kwargs)

    monkeypatch.setattr(vllm, "LLM", Fake)
    start_engine(str(target / "target"), config(target, temperature=0.7))
    assert seen["enable_chunked_prefill"] is False and seen["max_num_batched_tokens"] >= 96
    seen.clear()
    start_engine(str(target / "target"), config(target))
    assert "enable_chunked_prefill" not in seen  # greedy replies keep vLLM's defaults
    monkeypatch.undo()

    greedy = build_dataset(config(target), tmp_path / "greedy", progress=False, llm=llm)
    sampled = build_dataset(config(target, temperature=0.7), tmp_path / "sampled", progress=False, llm=llm)
    assert sampled["complete"] and sampled["counts"]["conversations"] == greedy["counts"]["conversations"]
    a, b = shards(tmp_path / "greedy"), shards(tmp_path / "sampled")
    assert any(not np.array_equal(a[n]["input_ids"], b[n]["input_ids"]) for n in a)  # sampling changed replies


def test_a_request_left_in_the_engine_is_not_taken_for_ours(target, llm, tmp_path):
    """A build interrupted in the same process (the engine shared, as here) may leave requests in
    flight; the next build's requests have ids of their own and skip outputs that are not theirs."""
    from vllm import SamplingParams

    llm.llm_engine.add_request("0-0-0", {"prompt_token_ids": [1, 5, 9, 13]},  # an old-style id of shard 0
                               SamplingParams(temperature=0, max_tokens=MAX_NEW, detokenize=False))
    meta = build_dataset(config(target), tmp_path / "after", progress=False, llm=llm)
    assert meta["complete"] and meta["counts"]["conversations"] == 5
