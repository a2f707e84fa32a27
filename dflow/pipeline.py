"""The Python API: a target, its tokenizer and (optionally) a drafter, loaded once.

    pipe = Pipeline.load("smollm2-135m", dtype="bfloat16", device="auto")  # auto: CUDA when present
    result = pipe.generate(pipe.encode("Write a haiku."), method="dflow", max_new_tokens=64)
    print(pipe.decode(result.token_ids), result.tau)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from dflow.drafter import check_block_size
from dflow.engine import GenerationResult, generate
from dflow.errors import DFlowError
from dflow.model import DFlowDrafter, check_fits_target, config_for_target, load_drafter, pick_mask_token_id
from dflow.proposers import DrafterProposer, proposer_for
from dflow.sampling import SamplingParams
from dflow.targets import ALIASES, load_target, parse_dtype, resolve_device
from dflow.vocab import count_supervised, pick_draft_vocab


def default_drafter_dir(target: str) -> Path | None:
    """The trained drafter shipped for an alias, if any."""
    if target not in ALIASES:
        return None
    path = Path(__file__).parent / "assets" / "drafters" / target
    return path if (path / "model.safetensors").exists() else None


# A fresh drafter's shape (docs/training.md, the F ablations: at equal compute a 2-layer drafter fusing
# 5 target layers beat 5 layers fusing 5 and 2 layers fusing 2 on held-out acceptance, and its
# rounds cost less).
DEFAULT_LAYERS = 2
DEFAULT_TARGET_LAYERS = 5


def default_target_layers(layers: int, target_layers_total: int) -> int:
    """Fused target layers of a fresh drafter: DEFAULT_TARGET_LAYERS, or its own layer count when
    larger, at most the target's layers."""
    return min(max(layers, DEFAULT_TARGET_LAYERS), target_layers_total)


def init_drafter(target_model, tokenizer=None, layers: int = DEFAULT_LAYERS, block_size: int = 16, seed: int = 0,
                 relay: bool = True, target_layers: int | None = None,
                 draft_vocab: torch.Tensor | None = None) -> DFlowDrafter:
    """A freshly initialised drafter (relay a no-op) sized for a target: the start of training.
    `target_layers`: how many target layers it fuses (default: `default_target_layers`).
    `draft_vocab`: d2t [N], the target ids of a reduced draft vocabulary (`vocab.pick_draft_vocab`)."""
    if layers < 1:
        raise DFlowError("--layers must be >= 1")
    n = target_model.config.num_hidden_layers
    if target_layers is not None and not 1 <= target_layers <= n:
        raise DFlowError(f"--target-layers must be in 1..{n} (the target's layers), got {target_layers}")
    target_layers = target_layers or default_target_layers(layers, n)
    check_block_size(block_size, "--block-size")
    cfg = config_for_target(target_model.config, layers, block_size, pick_mask_token_id(target_model.config, tokenizer),
                            relay=relay, target_layers=target_layers)
    if draft_vocab is None:
        return DFlowDrafter(cfg).init_weights(seed)
    drafter = DFlowDrafter(replace(cfg, draft_vocab_size=draft_vocab.numel())).init_weights(seed)
    drafter.dflash.d2t.copy_(draft_vocab)
    return drafter


def draft_vocab_of(examples, target_model, size: int | None) -> torch.Tensor | None:
    """`--draft-vocab N`: the N most frequent supervised target ids of `examples` ((ids, loss_mask)
    pairs) -> d2t [N]; None (the full vocabulary) without N."""
    if size is None:
        return None
    return pick_draft_vocab(count_supervised(examples, target_model.config.vocab_size), size)


def _check_utf8(text) -> None:
    """Undecodable bytes in a command-line argument reach Python as lone surrogates (U+DC80..U+DCFF),
    which no tokenizer takes: one clear error instead."""
    if not isinstance(text, str):
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        byte = f" (byte 0x{code - 0xDC00:02x})" if 0xDC80 <= code <= 0xDCFF else ""
        raise DFlowError(f"the prompt is not valid UTF-8 text: character {e.start}{byte} cannot be encoded; "
                         "pass UTF-8 text") from None


@dataclass
class Pipeline:
    target: torch.nn.Module
    tokenizer: object
    drafter: DFlowDrafter | None
    drafter_note: str = ""  # where the drafter came from, for the user
    fresh_drafter: bool = False  # an untrained drafter stands in (no trained one ships yet)

    @classmethod
    def load(cls, target: str, drafter: str | None = None, dtype: str | torch.dtype = "float32",
             need_drafter: bool = True, device: str | torch.device = "auto") -> "Pipeline":
        """Target, tokenizer and drafter, all on `device` (`auto`: CUDA when present, else the CPU)."""
        dtype = parse_dtype(dtype) if isinstance(dtype, str) else dtype
        device = resolve_device(device)
        model, tok = load_target(target, dtype, device)
        draft, note, path = None, "", None
        if need_drafter:
            path = Path(drafter) if drafter else default_drafter_dir(target)
            if path is not None:
                draft, note = load_drafter(path, dtype), f"drafter {path}"
            else:
                draft = init_drafter(model, tok).to(dtype).eval()
                note = (f"no trained drafter ships for {target!r} yet: using a FRESHLY INITIALISED drafter "
                        "(untrained, expect tau near 1; pass --drafter DIR)")
            check_fits_target(draft.cfg, model.config)
            draft.to(device)
        return cls(model, tok, draft, note, fresh_drafter=draft is not None and not path)

    @property
    def stop_token_ids(self) -> list[int]:
        ids = set()
        for src in (getattr(self.target, "generation_config", None), self.tokenizer):
            eos = getattr(src, "eos_token_id", None)
            ids.update([eos] if isinstance(eos, int) else (eos or []))
        return sorted(ids)

    def encode(self, prompt: str | list[dict], chat: bool | None = None) -> list[int]:
        """Text (or a list of chat messages) -> prompt ids; chat template on by default when present."""
        if isinstance(prompt, str) and not prompt.strip():
            raise DFlowError("the prompt is empty")
        for text in [prompt] if isinstance(prompt, str) else [m.get("content") for m in prompt]:
            _check_utf8(text)
        has_template = bool(getattr(self.tokenizer, "chat_template", None))
        if chat is None:
            chat = has_template
        if chat and not has_template:
            raise DFlowError("--chat: this tokenizer has no chat template")
        if chat:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if not isinstance(ids, list):  # transformers 5 may return a BatchEncoding
                ids = ids["input_ids"]
            return list(ids)
        return self.tokenizer(prompt, add_special_tokens=True)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def proposer(self, method: str) -> DrafterProposer | None:
        return proposer_for(method, self.drafter, self.target)

    def generate(self, prompt_ids: list[int], method: str = "dflow", max_new_tokens: int = 128,
                 block_size: int | None = None, params: SamplingParams = SamplingParams(),
                 on_commit=None) -> GenerationResult:
        proposer = self.proposer(method)
        if block_size is None:
            block_size = self.drafter.cfg.block_size if self.drafter is not None else 16
        return generate(self.target, prompt_ids, proposer=proposer, block_size=block_size,
                        max_new_tokens=max_new_tokens, stop_token_ids=self.stop_token_ids,
                        params=params, on_commit=on_commit)
