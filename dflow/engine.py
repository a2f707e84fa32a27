"""One decode loop for `ar`, `dflash` and `dflow`: prefill, then rounds of
draft -> verify -> accept -> commit -> relay.

The engine knows nothing about tokenization or chat templates: it takes token ids and returns
token ids plus per-round statistics. A proposer supplies drafts (none for `ar`, whose rounds are
blocks of one token: the AR baseline runs through the same path).

Device: every tensor the loop makes lives on the target's device, the sampling generator too; the
only host copy in a round is the one acceptance needs (a and the committed ids). On a GPU the
per-stage times of `RoundStats` therefore fall where that copy waits (bookkeeping); the round's
total is exact.

Glossary (docs/DESIGN.md): committed tokens occupy positions 0..s; the *anchor* is the last
committed token (position s, not yet seen by the target); a round's block is positions
s..s+V-1 (V <= B, smaller only for the last round); `a` = accepted drafts (the *accepted
prefix* d_1..d_a); the *bonus* is the target's token at the first mismatch and becomes the next
anchor at s' = s+a+1; the *rejected suffix* is block indices a+1..V-1, whose verifier states
DFlow relays.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from dflow import metrics, sampling
from dflow.attention import decode_cache, sdpa_backends
from dflow.drafter import check_block_size
from dflow.errors import DFlowError
from dflow.metrics import RoundStats
from dflow.sampling import SamplingParams
from dflow.targets import crop_cache, target_features


@dataclass
class GenerationResult:
    token_ids: list[int]  # new tokens only
    rounds: list[RoundStats] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    stopped: bool = False  # ended on a stop token

    @property
    def tau(self) -> float:
        """`metrics.tau` of this generation (nan when it had no decode round)."""
        return metrics.tau([self.rounds])

    @property
    def accepted(self) -> list[int]:
        return [r.accepted for r in self.rounds]

    @property
    def tokens_per_s(self) -> float:
        return metrics.tokens_per_s(sum(r.committed for r in self.rounds), self.decode_s)


class Proposer(Protocol):
    """Drafts for the engine (dflow/proposers.py). Per generation the engine calls `prefill` once,
    then per round `propose`, and after the round's commit `commit` and `relay_rejected`, in
    either order: relayed inputs serve the next `propose` only. Target hidden states reach them
    through `fuse`, once per forward, so that `commit` and `relay_rejected` share one fusion of
    the verified block. `layer_ids` empty: the proposer needs no target hidden states (and gets
    None for them)."""

    layer_ids: tuple[int, ...]

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Raw target features [1, t, F] (the `layer_ids` outputs, concatenated) -> the context
        states [1, t, C] that `prefill`, `commit` and `relay_rejected` take."""

    def prefill(self, context: torch.Tensor | None, capacity: int) -> None:
        """context [1, n, C] of the prompt (positions 0..n-1); capacity: positions the run may commit."""

    def propose(self, anchor: torch.Tensor, position: int, size: int) -> torch.Tensor:
        """anchor [1] at `position` -> draft logits [1, size-1, vocab] for the next size-1 positions."""

    def commit(self, context: torch.Tensor | None, position: int) -> None:
        """context [1, a+1, C] of the committed positions position..position+a."""

    def relay_rejected(self, context: torch.Tensor, tokens: torch.Tensor, accepted: torch.Tensor,
                       bonus: torch.Tensor) -> None:
        """The verified block: context [1, V, C], tokens [1, V] = [anchor, d_1..d_{V-1}];
        accepted [1] = a; bonus [1] = b (the next anchor)."""


def check_prompt(num_tokens: int, max_new_tokens: int, context: int) -> int:
    """Validate a prompt length; return max_new_tokens clamped to the context."""
    if num_tokens == 0:
        raise DFlowError("the prompt is empty")
    if num_tokens >= context:
        raise DFlowError(f"the prompt has {num_tokens} tokens; the target's context is {context}")
    if max_new_tokens < 1:
        raise DFlowError("max_new_tokens must be >= 1")
    return min(max_new_tokens, context - num_tokens)


def on_target_attention(fn):
    """Run `fn(target, ...)` under `sdpa_backends` of the target's device (on a GPU: attention
    kernels other than cuDNN's, which plans anew for every shape; dflow.attention)."""
    @functools.wraps(fn)
    def run(target, *args, **kwargs):
        with sdpa_backends(target.get_input_embeddings().weight.device):
            return fn(target, *args, **kwargs)
    return run


@torch.inference_mode()
@on_target_attention
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
    if proposer is not None:
        check_block_size(block_size)
    device = target.get_input_embeddings().weight.device
    ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=device).reshape(1, -1)  # [1, n]
    n = ids.shape[1]
    max_new_tokens = check_prompt(n, max_new_tokens, target.config.max_position_embeddings)
    block_size = block_size if proposer is not None else 1
    layer_ids = proposer.layer_ids if proposer is not None else ()
    gen = torch.Generator(device=device).manual_seed(params.seed) if params.seed is not None else None
    stops = set(stop_token_ids)
    cache = decode_cache(target.config, n + max_new_tokens)  # written in place; a crop moves its end

    # Prefill: the prompt's KV and features; its last logits give the first new token.
    t0 = time.perf_counter()
    out = target(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1,
                 output_hidden_states=bool(layer_ids))
    if proposer is not None:
        context = proposer.fuse(target_features(out.hidden_states, layer_ids)) if layer_ids else None  # [1, n, C]
        proposer.prefill(context, n + max_new_tokens)
    _, anchor = sampling.accept_drafts(ids[:, :0], None, out.logits[:, -1:], params, gen)  # [1]
    result = GenerationResult(token_ids=anchor.tolist())
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
            draft, draft_probs = sampling.draw_drafts(draft_logits, params, gen)  # [1, V-1]
        else:
            draft, draft_probs = anchor.new_empty(1, 0), None
        t1 = time.perf_counter()
        # 2. Verify: the target scores [anchor, d_1..d_{V-1}] at positions s..s+V-1.
        block = torch.cat([anchor[:, None], draft], dim=1)  # [1, V]
        out = target(input_ids=block, position_ids=torch.arange(s, s + V, device=device)[None],
                     past_key_values=cache, use_cache=True, output_hidden_states=bool(layer_ids) and V > 1)
        t2 = time.perf_counter()
        # 3. Accept: the accepted prefix d_1..d_a, then the bonus at the first mismatch.
        accepted, bonus = sampling.accept_drafts(draft, draft_probs, out.logits, params, gen)  # [1], [1]
        # 4. Commit: d_1..d_a and the bonus (the round's one host copy); roll the target cache back
        #    to s+a+1 positions.
        host = torch.cat([accepted, draft[0], bonus]).tolist()
        a = host[0]
        new = host[1:1 + a] + host[-1:]
        for i, tok in enumerate(new):
            if tok in stops:
                new, result.stopped = new[: i + 1], True
                break
        result.token_ids.extend(new)
        crop_cache(cache, s + a + 1)
        anchor = bonus
        t3 = time.perf_counter()
        done = result.stopped or len(result.token_ids) >= max_new_tokens
        context = None
        if proposer is not None and not done:
            if layer_ids and V > 1:
                context = proposer.fuse(target_features(out.hidden_states, layer_ids))  # [1, V, C]
            proposer.commit(context[:, : a + 1] if context is not None else None, s)
        t4 = time.perf_counter()
        # 5. Relay (DFlow): verifier states of the rejected suffix seed the next block.
        if context is not None:
            proposer.relay_rejected(context, block, accepted, bonus)
        t5 = time.perf_counter()
        s += a + 1
        result.rounds.append(RoundStats(accepted=a, committed=len(new), drafted=V - 1, draft_s=(t1 - t0) + (t4 - t3),
                                        relay_s=t5 - t4, verify_s=t2 - t1, bookkeeping_s=t3 - t2))
        if on_commit:
            on_commit(new)
    result.decode_s = time.perf_counter() - t_decode
    return result
