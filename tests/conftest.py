"""Tiny random targets of each supported architecture, and a tiny target folder with a tokenizer."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM)

ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}
TINY_VOCAB = 64

# Tiny models are dominated by per-op overhead: one thread is faster, and immune to the
# oversubscription slow-down of a shared machine. The real-model tests raise it again.
torch.set_num_threads(1)


def tiny_target(arch: str = "llama", vocab: int = TINY_VOCAB, layers: int = 4, seed: int = 0, **kw):
    """A random target whose logits are well separated (large init) so float32 argmax is stable."""
    config_cls, model_cls = ARCHS[arch]
    cfg = config_cls(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                     initializer_range=0.3, tie_word_embeddings=False, **kw)
    torch.manual_seed(seed)
    return model_cls(cfg).eval().requires_grad_(False)


def training_examples(lengths=(30, 36, 41, 33), prompt: int = 5, vocab: int = 64, seed: int = 1):
    """(ids, loss_mask) training examples of random tokens, supervised after a `prompt`-token prefix."""
    gen = torch.Generator().manual_seed(seed)
    data = []
    for t in lengths:
        mask = torch.zeros(t, dtype=torch.bool)
        mask[prompt:] = True
        data.append((torch.randint(4, vocab, (t,), generator=gen), mask))
    return data


def vllm_tiny_llama(root, vocab: int, layers: int):
    """A random Llama that vLLM's CPU build runs (head size 32), float32, with vLLM set up to use a
    small KV cache and a cache folder under `root` (a test's temp folder)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's default takes a share of RAM
    os.environ.setdefault("VLLM_CACHE_ROOT", str(root / "vllm-cache"))
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                      initializer_range=0.3, tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def tiny_tokenizer(vocab: int = TINY_VOCAB) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<unk>", "<|im_start|>", "<|im_end|>", "<mask>"]
    words = {t: i for i, t in enumerate(specials + [f"w{i}" for i in range(vocab - len(specials))])}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>",
                                   additional_special_tokens=["<|im_start|>", "<mask>"])
    fast.chat_template = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
                          "{% endfor %}{% if add_generation_prompt %}<|im_start|> w1 {% endif %}")
    return fast


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory):
    """A local HF folder (tiny Llama + word-level tokenizer): what `--target DIR` takes."""
    path = tmp_path_factory.mktemp("tiny_target")
    model = tiny_target("llama")
    model.generation_config.eos_token_id = 2
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def drafter_dir(tiny_target_dir, tmp_path_factory):
    """A freshly initialised drafter for `tiny_target_dir`, written by `dflow init-drafter`."""
    from dflow.cli import main

    out = tmp_path_factory.mktemp("drafter") / "d"
    assert main(["init-drafter", "--target", str(tiny_target_dir), "--layers", "2", "--block-size", "4",
                 "--out", str(out)]) == 0
    return out


def read_json(path):
    return json.loads(open(path).read())
