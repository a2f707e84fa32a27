"""Step 2 of `dflow data`: the target answers each conversation's user turns, one turn at a time.

`Turns` holds the rules both engines share: append the chat template's text up to the next
assistant turn (ShareGPT's user turn), then the target's reply as generated ids. A reply cut by
`max_new_tokens` or `max_len` ends its conversation; a prompt that no longer fits in `max_len` ends
it too (truncated). `HFRegenerator` answers with HF `generate` (left padding, a queue that keeps
batches full); `dflow.data.vllm_engine.VllmRegenerator` with vLLM's offline `LLM`.

A regenerator's `run(shards, on_done, skip)` takes [(shard index, planned conversations)] and yields
(shard index, trajectories) as each shard is regenerated; `generated` and `seconds` count the
reply tokens and the time spent generating them.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from dflow.attention import sdpa_backends
from dflow.data.config import DataConfig
from dflow.data.plan import Planned
from dflow.errors import DFlowError


@dataclass
class Trajectory:
    """One conversation being regenerated: its tokens so far and which of them the target wrote."""

    pieces: list[str]
    ids: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    turn: int = 0
    done: bool = False
    truncated: bool = False  # stopped by max_len
    unfinished: bool = False  # last reply cut by max_new_tokens


def end_token_ids(generation_config, tokenizer) -> set[int]:
    """The target's end-of-turn ids (generation_config first, the tokenizer's eos otherwise)."""
    eos = generation_config.eos_token_id if generation_config is not None else None
    eos = eos if eos is not None else tokenizer.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos])
    if not ids or None in ids:
        raise DFlowError("the target defines no end-of-turn token (generation_config.eos_token_id)")
    return ids


class Turns:
    """The turn-by-turn rules: what is appended to a trajectory before and after each reply."""

    def __init__(self, tokenizer, eos_ids: set[int], max_len: int, max_new_tokens: int):
        self.tokenizer, self.eos_ids = tokenizer, eos_ids
        self.max_len, self.max_new_tokens = max_len, max_new_tokens
        self.eos_text = {e: tokenizer.decode([e]) for e in eos_ids}

    def add_prompt(self, t: Trajectory) -> bool:
        """Append the template text before reply t.turn; False when the conversation is over."""
        if t.turn == len(t.pieces):
            t.done = True
            return False
        piece = t.pieces[t.turn]
        closing = self.eos_text.get(t.ids[-1]) if t.ids else None
        if closing and piece.startswith(closing):
            piece = piece[len(closing):]  # the reply's own end token already closed the turn
        ids = self.tokenizer(piece, add_special_tokens=False).input_ids
        if len(t.ids) + len(ids) >= self.max_len:
            t.done = t.truncated = True
            return False
        t.ids += ids
        t.mask += [False] * len(ids)
        return True

    def cap(self, t: Trajectory) -> int:
        """The most reply tokens trajectory t may take now."""
        return min(self.max_new_tokens, self.max_len - len(t.ids))

    def add_reply(self, t: Trajectory, reply: list[int]) -> None:
        t.ids += reply
        t.mask += [True] * len(reply)
        t.turn += 1
        if reply[-1] not in self.eos_ids:
            t.done = True
            t.truncated = len(t.ids) >= self.max_len
            t.unfinished = not t.truncated


def generate_batch(model, prompts: list[list[int]], caps: list[int], eos_ids: set[int], pad_id: int,
                   temperature: float) -> list[list[int]]:
    """The target's reply to each prompt: at most caps[i] tokens, ending at its first end token."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id)  # [batch, width], left padded
    attention_mask = torch.zeros_like(input_ids)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p):] = torch.tensor(p)
        attention_mask[i, width - len(p):] = 1
    sampling = {"do_sample": False}
    if temperature > 0:
        sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    with torch.inference_mode(), sdpa_backends(model.device):
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max(caps),
                             eos_token_id=sorted(eos_ids), pad_token_id=pad_id, **sampling)
    replies = []
    for row, cap in zip(out[:, width:].tolist(), caps):
        row = row[:cap]
        end = next((j for j, t in enumerate(row) if t in eos_ids), None)
        replies.append(row if end is None else row[: end + 1])
    return replies


class HFRegenerator:
    """Runs conversations through an HF target turn by turn, in batches, one shard at a time."""

    def __init__(self, model, tokenizer, eos_ids: set[int], cfg: DataConfig):
        self.model, self.cfg = model, cfg
        self.turns = Turns(tokenizer, eos_ids, cfg.max_len, cfg.max_new_tokens)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos_ids)
        self.generated, self.seconds = 0, 0.0  # reply tokens and time spent in generate, this run

    def run(self, shards: list[tuple[int, list[Planned]]], on_done=lambda t: None, skip=lambda k: False):
        """Yield (k, trajectories) for each shard of `shards`, in order; `skip(k)` true: shard k
        was finished meanwhile by another process."""
        for k, convs in shards:
            if skip(k):
                continue
            torch.manual_seed(self.cfg.seed + k)  # a resumed shard samples as an uninterrupted run would
            yield k, self.run_shard(convs, on_done)

    def run_shard(self, convs: list[Planned], on_done) -> list[Trajectory]:
        """Regenerate `convs`; each generate call answers one turn of up to batch_size of them.

        Conversations wait in a queue: one with turns left goes back to its end, and a finished one
        frees its batch slot for the next, so batches stay full until the queue drains.
        """
        trajs = [Trajectory(c.pieces) for c in convs]
        queue = deque(trajs)
        while queue:
            batch = []
            while queue and len(batch) < self.cfg.batch_size:
                t = queue.popleft()
                if self.turns.add_prompt(t):
                    batch.append(t)
                else:
                    on_done(t)
            if not batch:
                break
            start = time.perf_counter()
            replies = generate_batch(self.model, [t.ids for t in batch], [self.turns.cap(t) for t in batch],
                                     self.turns.eos_ids, self.pad_id, self.cfg.temperature)
            self.seconds += time.perf_counter() - start
            for t, reply in zip(batch, replies):
                self.turns.add_reply(t, reply)
                self.generated += len(reply)
                if t.done:
                    on_done(t)
                else:
                    queue.append(t)
        return trajs
