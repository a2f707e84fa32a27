"""One decode loop for `ar`, `dflash` and `dflow`: prefill, then rounds of
draft -> verify -> accept -> commit -> relay.

The engine knows nothing about tokenization or chat templates: it takes token ids and returns
token ids plus per-round statistics. A proposer supplies drafts (none for `ar`, whose rounds are
blocks of one token: the AR baseline runs through the same path).

Glossary (DESIGN.md): committed tokens occupy positions 0..s; the *anchor* is the last committed
token (position s, not yet seen by the target); a round's block is positions s..s+V-1
(V <= B, smaller only for the last round); `a` = accepted drafts; the *bonus* is the target's
token at the first mismatch and becomes the next anchor at s' = s+a+1; the *rejected suffix*
is block indices a+1..V-1, whose verifier states DFlow relays.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
from transformers import DynamicCache

from dflow import sampling
from dflow.errors import DFlowError


@dataclass
class RoundStats:
    accepted: int  # a: drafts accepted
    committed: int  # tokens committed (a + 1 unless a stop token or max_new_tokens cut the round)
    drafted: int  # draft positions proposed (V - 1; 0 for ar)
    draft_s: float = 0.0
    relay_s: float = 0.0
    verify_s: float = 0.0
    bookkeeping_s: float = 0.0


@dataclass
class GenerationResult:
    token_ids: list[int]  # new tokens only
    rounds: list[RoundStats] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    stopped: bool = False  # ended on a stop token

    @property
    def tau(self) -> float:
        """Tokens committed per decode round, bonus included (DESIGN.md)."""
        return sum(r.committed for r in self.rounds) / len(self.rounds) if self.rounds else 0.0

    @property
    def accepted(self) -> list[int]:
        return [r.accepted for r in self.rounds]

    @property
    def tokens_per_s(self) -> float:
        n = sum(r.committed for r in self.rounds)
        return n / self.decode_s if self.decode_s > 0 else 0.0


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0
    top_p: float = 1.0
    rule: str = "rejection"  # or "match" (the DFlash reference's sample-and-match)
    seed: int | None = None

    def __post_init__(self):
        sampling.validate_sampling(self.temperature, self.top_k, self.top_p)
        if self.rule not in ("rejection", "match"):
            raise ValueError(f"unknown verification rule {self.rule!r}; choose rejection or match")


class Proposer(Protocol):
    """Drafts for the engine. `layer_ids` empty: the proposer needs no target hidden states."""

    layer_ids: tuple[int, ...]

    def start(self, features: torch.Tensor | None) -> None: ...  # prompt features [1, n, F]

    def propose(self, anchor: torch.Tensor, start: int, size: int) -> torch.Tensor: ...  # -> logits [1, size-1, vocab]

    def commit(self, features: torch.Tensor | None, start: int) -> None: ...  # committed features [1, a+1, F]

    def relay(self, features: torch.Tensor, bonus: torch.Tensor, rejected: torch.Tensor) -> None: ...


def target_features(hidden_states: tuple[torch.Tensor, ...], layer_ids) -> torch.Tensor:
    """Chosen layers' outputs (HF tuple index id + 1), concatenated: [1, t, n_layers * hidden]."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


def crop_cache(cache: DynamicCache, length: int) -> None:
    """Roll the target KV cache back to its first `length` positions."""
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


def check_prompt(num_tokens: int, max_new_tokens: int, context: int) -> int:
    """Validate a prompt length; return max_new_tokens clamped to the context."""
    if num_tokens == 0:
        raise DFlowError("the prompt is empty")
    if num_tokens >= context:
        raise DFlowError(f"the prompt has {num_tokens} tokens; the target's context is {context}")
    if max_new_tokens < 1:
        raise DFlowError("max_new_tokens must be >= 1")
    return min(max_new_tokens, context - num_tokens)


@torch.inference_mode()
def generate(
    target,
    prompt_ids: list[int] | torch.Tensor,
    *,
    proposer: Proposer | None = None,
    block_size: int = 16,
    max_new_tokens: int = 128,
    stop_token_ids: tuple[int, ...] | list[int] = (),
    params: SamplingParams = SamplingParams(),
    on_commit: Callable[[list[int]], None] | None = None,
) -> GenerationResult:
    """Generate up to `max_new_tokens` new tokens; lossless w.r.t. the target's own decoding."""
    if not 1 <= block_size <= 64:
        raise DFlowError(f"block size must be in 2..64 (1 for ar), got {block_size}")
    ids = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(1, -1)  # [1, n]
    n = ids.shape[1]
    max_new_tokens = check_prompt(n, max_new_tokens, target.config.max_position_embeddings)
    block_size = block_size if proposer is not None else 1
    layer_ids = proposer.layer_ids if proposer is not None else ()
    gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
    stops = set(stop_token_ids)
    cache = DynamicCache(config=target.config)

    # Prefill: the prompt's KV and features; its last logits give the first new token.
    t0 = time.perf_counter()
    out = target(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1,
                 output_hidden_states=bool(layer_ids))
    if proposer is not None:
        proposer.start(target_features(out.hidden_states, layer_ids) if layer_ids else None)
    _, first = sampling.accept(ids[:, :0], None, out.logits[:, -1:], params.temperature,
                               params.top_k, params.top_p, gen, params.rule)
    anchor = first  # [1]
    result = GenerationResult(token_ids=[int(first)])
    result.prefill_s = time.perf_counter() - t0
    if on_commit:
        on_commit(result.token_ids[:])
    result.stopped = result.token_ids[0] in stops
    s = n  # the anchor's position

    t_decode = time.perf_counter()
    while not result.stopped and len(result.token_ids) < max_new_tokens:
        V = min(block_size, max_new_tokens - len(result.token_ids))
        t0 = time.perf_counter()
        # 1. Draft: V-1 proposals for positions s+1..s+V-1.
        if V > 1:
            draft_logits = proposer.propose(anchor, s, V)  # [1, V-1, vocab]
            draft, draft_probs = sampling.draft_tokens(draft_logits, params.temperature, params.top_k,
                                                       params.top_p, gen)  # [1, V-1]
        else:
            draft, draft_probs = anchor.new_empty(1, 0), None
        t1 = time.perf_counter()
        # 2. Verify: the target scores [anchor, d_1..d_{V-1}] at positions s..s+V-1.
        block = torch.cat([anchor[:, None], draft], dim=1)  # [1, V]
        out = target(input_ids=block, position_ids=torch.arange(s, s + V)[None], past_key_values=cache,
                     use_cache=True, output_hidden_states=bool(layer_ids) and V > 1)
        t2 = time.perf_counter()
        # 3. Accept: the longest verified prefix, then the bonus token.
        accepted, bonus = sampling.accept(draft, draft_probs, out.logits, params.temperature,
                                          params.top_k, params.top_p, gen, params.rule)
        a = int(accepted)
        # 4. Commit: d_1..d_a and the bonus; roll the target cache back to s+a+1 positions.
        new = draft[0, :a].tolist() + [int(bonus)]
        for i, tok in enumerate(new):
            if tok in stops:
                new, result.stopped = new[: i + 1], True
                break
        result.token_ids.extend(new)
        crop_cache(cache, s + a + 1)
        anchor = bonus
        t3 = time.perf_counter()
        done = result.stopped or len(result.token_ids) >= max_new_tokens
        feats = None
        if proposer is not None and not done:
            feats = target_features(out.hidden_states, layer_ids) if layer_ids and V > 1 else None  # [1, V, F]
            proposer.commit(feats[:, : a + 1] if feats is not None else None, s)
        t4 = time.perf_counter()
        # 5. Relay (DFlow): verifier states of the rejected suffix seed the next block.
        if feats is not None and a < V - 1:
            proposer.relay(feats[:, a + 1:], bonus, draft[:, a])
        t5 = time.perf_counter()
        s += a + 1
        result.rounds.append(RoundStats(accepted=a, committed=len(new), drafted=V - 1, draft_s=(t1 - t0) + (t4 - t3),
                                        relay_s=t5 - t4, verify_s=t2 - t1, bookkeeping_s=t3 - t2))
        if on_commit:
            on_commit(new)
    result.decode_s = time.perf_counter() - t_decode
    return result
