"""Prompt-lookup decoding (PLD): transformers' drafter-free speculative decoding, as a bench method.

`generate_pld` runs `target.generate(..., prompt_lookup_num_tokens=10)` and returns the engine's
`GenerationResult`, so PLD goes through the same metrics and report as `ar`/`dflash`/`dflow`.

How the rounds are observed (public hooks only, no transformers internals): a forward pre-hook and
hook on the target time each target forward and read its input length; a streamer timestamps each
commit. HF's assisted loop does exactly one forward and one commit per iteration.

Timing choice: HF's first forward is the prefill (the prompt plus up to 10 candidates already
looked up in it), so `prefill_s` runs from the call to the first commit, and `decode_s` from the
first commit to the return. That first forward is not a decode round (docs/DESIGN.md): its tokens
(usually 1) count as the prefill token, like the engine's. Per decode round: `drafted` = tokens
verified - 1, `accepted` = committed - 1; the time split is draft = from the previous commit to
the forward (HF's n-gram lookup and loop bookkeeping), verify = the forward, bookkeeping = from the
forward to the commit (acceptance, cache crop); relay = 0.
"""

from __future__ import annotations

import time

import torch

from dflow.attention import sdpa_backends
from dflow.engine import GenerationResult, check_prompt
from dflow.metrics import RoundStats
from dflow.sampling import SamplingParams

NUM_CANDIDATES = 10  # prompt_lookup_num_tokens
BLOCK_SIZE = NUM_CANDIDATES + 1  # verified tokens per round at most: candidates + bonus


class _Clock:
    """Timestamps of the target's forwards (start, end, tokens in) and of the streamer's commits."""

    def __init__(self):
        self.forwards: list[list[float]] = []  # [start, end, num_input_tokens]
        self.commits: list[tuple[float, int]] = []  # (time, num_tokens); the prompt comes first

    def pre_forward(self, module, args, kwargs) -> None:
        self.forwards.append([time.perf_counter(), 0.0, kwargs["input_ids"].shape[1]])

    def post_forward(self, module, args, output) -> None:
        self.forwards[-1][1] = time.perf_counter()

    def put(self, value: torch.Tensor) -> None:  # the streamer protocol
        self.commits.append((time.perf_counter(), value.numel()))

    def end(self) -> None:
        pass


def _rounds(clock: _Clock) -> list[RoundStats]:
    """Decode rounds from the timestamps: forward i (i >= 1) ends in commit i (commit 0 is the prefill)."""
    commits = clock.commits[1:]  # drop the prompt
    if len(commits) != len(clock.forwards):
        raise RuntimeError(f"PLD: {len(clock.forwards)} target forwards but {len(commits)} commits")
    rounds = []
    for i in range(1, len(commits)):
        start, end, n_in = clock.forwards[i]
        t_commit, committed = commits[i]
        rounds.append(RoundStats(accepted=committed - 1, committed=committed, drafted=n_in - 1,
                                 draft_s=start - commits[i - 1][0], verify_s=end - start,
                                 bookkeeping_s=t_commit - end))
    return rounds


@torch.inference_mode()
def generate_pld(target, prompt_ids: list[int], max_new_tokens: int, stop_token_ids: list[int],
                 params: SamplingParams = SamplingParams()) -> GenerationResult:
    """PLD on `prompt_ids`, sampling like the engine (greedy at T = 0), stopping on the same tokens."""
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=target.get_input_embeddings().weight.device)  # [1, n]
    max_new_tokens = check_prompt(ids.shape[1], max_new_tokens, target.config.max_position_embeddings)
    sampling = {}
    if params.temperature > 0:
        sampling = {"temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p}
        if params.seed is not None:
            torch.manual_seed(params.seed)
    clock = _Clock()
    hooks = (target.register_forward_pre_hook(clock.pre_forward, with_kwargs=True),
             target.register_forward_hook(clock.post_forward))
    try:
        t0 = time.perf_counter()
        with sdpa_backends(ids.device):
            out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                  prompt_lookup_num_tokens=NUM_CANDIDATES, do_sample=params.temperature > 0,
                                  eos_token_id=list(stop_token_ids) or None,
                                  pad_token_id=stop_token_ids[0] if stop_token_ids else None,
                                  streamer=clock, **sampling)  # [1, n + new]
        t_end = time.perf_counter()
    finally:
        for h in hooks:
            h.remove()
    new = out[0, ids.shape[1]:].tolist()
    t_first = clock.commits[1][0]
    stops = set(stop_token_ids)
    return GenerationResult(token_ids=new, rounds=_rounds(clock), prefill_s=t_first - t0,
                            decode_s=t_end - t_first, stopped=bool(new) and new[-1] in stops)
