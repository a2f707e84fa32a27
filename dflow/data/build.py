"""`dflow data`: build a training set whose assistant turns are the target's own replies.

1. Plan: stream ShareGPT, shuffle it with the seed, walk it until `num_conversations` are chosen;
   malformed records, conversations whose first user turn is an evaluation prompt and ones whose
   first prompt already fills `max_len` are counted and passed over.
2. Regenerate, a batch of conversations at a time, turn by turn: append the chat template's text up
   to the next assistant turn (ShareGPT's user turn), then let the target answer it (HF `generate`,
   left padding, greedy unless a temperature is set). A reply cut by `max_new_tokens` or `max_len`
   ends its conversation; a prompt that no longer fits in `max_len` ends it too (truncated).
3. Write shard k (conversations k*S .. k*S+S-1 of the plan) atomically; an existing shard is kept,
   so re-running the same command resumes. With `shard=(i, n)` a process builds only the shards
   k with k % n == i, so n processes (one per core) fill one folder together; meta.json is
   rewritten under a file lock from the shards on disk, so it lists every process's shards.

The token sequence is exactly what the target read and wrote: template pieces are tokenized
between the replies, and the replies stay the generated ids (never decoded and re-tokenized).
"""

from __future__ import annotations

import fcntl
import random
import sys
import time
from collections import Counter, deque
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from jinja2.exceptions import TemplateError
from tqdm import tqdm

from dflow.data.sharegpt import iter_json_array, packaged_sharegpt, to_conversation
from dflow.data.shards import (FORMAT, check_target, id_dtype, read_meta, read_shard_metadata, shard_name,
                               target_identity, write_meta, write_shard)
from dflow.datasets import eval_prompt_texts, normalize_text
from dflow.errors import DFlowError
from dflow.targets import DEFAULT_TARGET, load_target

SENTINEL = "<<dflow-reply-{}>>"  # stands in for reply k when rendering the chat template
CONTAINMENT_MIN_CHARS = 64  # eval prompts this long are also dropped when found inside a user turn
LOCK = ".lock"  # taken while meta.json is rewritten
STAT_KEYS = ("conversations", "tokens", "assistant_tokens", "truncated", "unfinished_replies", "generate_s")


@dataclass(frozen=True)
class DataConfig:
    target: str = DEFAULT_TARGET
    num_conversations: int = 1000
    max_len: int = 2048
    max_new_tokens: int = 512
    dtype: str = "bfloat16"
    seed: int = 0
    temperature: float = 0.0  # 0 = greedy
    shard_size: int = 64  # conversations per shard: the unit of resumption
    sharegpt: str | None = None  # a ShareGPT-format JSON file; None = the packaged one
    batch_size: int = 8  # not part of `settings()`: a resumed run may use another
    shard: tuple[int, int] | None = None  # (i, n): build only shards k % n == i; not part of `settings()`

    def __post_init__(self):
        for name, low in (("num_conversations", 1), ("max_len", 16), ("max_new_tokens", 1), ("shard_size", 1),
                          ("batch_size", 1)):
            if getattr(self, name) < low:
                raise DFlowError(f"--{name.replace('_', '-')} must be at least {low}, got {getattr(self, name)}")
        if self.temperature < 0:
            raise DFlowError(f"--temperature must be >= 0, got {self.temperature}")
        if self.shard is not None and not 0 <= self.shard[0] < self.shard[1]:
            raise DFlowError(f"--shard must be K/N with 0 <= K < N, got {self.shard[0]}/{self.shard[1]}")

    def settings(self) -> dict:
        """What decides the data: a resumed run must repeat these exactly."""
        return {k: v for k, v in asdict(self).items() if k not in ("target", "batch_size", "shard")}


@dataclass
class Planned:
    id: str  # ShareGPT id
    pieces: list[str]  # template text before reply k, for each user turn k


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


# ---- 1. plan ----------------------------------------------------------------------------------

class EvalFilter:
    """True for a first user turn equal to an eval prompt, or containing a long one (normalised)."""

    def __init__(self, texts: set[str]):
        self.exact = texts
        self.long = [t for t in texts if len(t) >= CONTAINMENT_MIN_CHARS]

    def __call__(self, turn: str) -> bool:
        s = normalize_text(turn)
        return s in self.exact or any(t in s for t in self.long if len(t) <= len(s))


def template_pieces(tokenizer, conv) -> list[str] | None:
    """The chat template's text before each assistant turn (None if the template rejects it).

    Rendered once with placeholder replies, then split at them: piece 0 runs from the start to the
    first generation prompt; piece k > 0 runs from the end of reply k-1 to the next one.
    """
    messages = [{"role": "system", "content": conv.system}] if conv.system else []
    for k, turn in enumerate(conv.user_turns):
        messages.append({"role": "user", "content": turn})
        if k + 1 < len(conv.user_turns):
            messages.append({"role": "assistant", "content": SENTINEL.format(k)})
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except TemplateError:
        return None
    pieces, start = [], 0
    for k in range(len(conv.user_turns) - 1):
        at = text.find(SENTINEL.format(k), start)
        if at < 0:
            return None
        pieces.append(text[start:at])
        start = at + len(SENTINEL.format(k))
    return pieces + [text[start:]]


def sharegpt_file(cfg: DataConfig) -> Path:
    path = Path(cfg.sharegpt) if cfg.sharegpt else packaged_sharegpt()
    if not path.is_file():
        raise DFlowError(f"ShareGPT file {path} does not exist")
    return path


def plan(cfg: DataConfig, tokenizer, path: Path) -> tuple[list[Planned], Counter]:
    """Choose the run's conversations, in a seeded order, and count what was passed over."""
    convs = [to_conversation(r, i) for i, r in enumerate(iter_json_array(path))]
    order = list(range(len(convs)))
    random.Random(cfg.seed).shuffle(order)
    is_eval = EvalFilter(eval_prompt_texts())
    counts = Counter(records=len(convs), eval_prompts=len(is_eval.exact), visited=0, malformed=0, contaminated=0,
                     skipped_no_assistant=0)
    chosen: list[Planned] = []
    for i in order:
        if len(chosen) == cfg.num_conversations:
            break
        counts["visited"] += 1
        conv = convs[i]
        pieces = template_pieces(tokenizer, conv) if conv else None
        if pieces is None:
            counts["malformed"] += 1
        elif is_eval(conv.user_turns[0]):
            counts["contaminated"] += 1
        elif len(tokenizer(pieces[0], add_special_tokens=False).input_ids) >= cfg.max_len:
            counts["skipped_no_assistant"] += 1
        else:
            chosen.append(Planned(conv.id, pieces))
    return chosen, counts


# ---- 2. regenerate ----------------------------------------------------------------------------

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
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max(caps),
                             eos_token_id=sorted(eos_ids), pad_token_id=pad_id, **sampling)
    replies = []
    for row, cap in zip(out[:, width:].tolist(), caps):
        row = row[:cap]
        end = next((j for j, t in enumerate(row) if t in eos_ids), None)
        replies.append(row if end is None else row[: end + 1])
    return replies


class Regenerator:
    """Runs conversations through the target turn by turn, in batches."""

    def __init__(self, model, tokenizer, cfg: DataConfig):
        self.model, self.tokenizer, self.cfg = model, tokenizer, cfg
        eos = model.generation_config.eos_token_id
        eos = eos if eos is not None else tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])
        if not self.eos_ids or None in self.eos_ids:
            raise DFlowError("the target defines no end-of-turn token (generation_config.eos_token_id)")
        self.eos_text = {e: tokenizer.decode([e]) for e in self.eos_ids}
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_ids)
        self.generated, self.seconds = 0, 0.0  # reply tokens and time spent in generate, this run

    def _add_prompt(self, t: Trajectory) -> bool:
        """Append the template text before reply t.turn; False when the conversation is over."""
        if t.turn == len(t.pieces):
            t.done = True
            return False
        piece = t.pieces[t.turn]
        closing = self.eos_text.get(t.ids[-1]) if t.ids else None
        if closing and piece.startswith(closing):
            piece = piece[len(closing):]  # the reply's own end token already closed the turn
        ids = self.tokenizer(piece, add_special_tokens=False).input_ids
        if len(t.ids) + len(ids) >= self.cfg.max_len:
            t.done = t.truncated = True
            return False
        t.ids += ids
        t.mask += [False] * len(ids)
        return True

    def _add_reply(self, t: Trajectory, reply: list[int]) -> None:
        t.ids += reply
        t.mask += [True] * len(reply)
        t.turn += 1
        if reply[-1] not in self.eos_ids:
            t.done = True
            t.truncated = len(t.ids) >= self.cfg.max_len
            t.unfinished = not t.truncated

    def run(self, convs: list[Planned], on_done=lambda t: None) -> list[Trajectory]:
        """Regenerate all `convs`; each generate call answers one turn of up to batch_size of them.

        Conversations wait in a queue: one with turns left goes back to its end, and a finished one
        frees its batch slot for the next, so batches stay full until the queue drains.
        """
        trajs = [Trajectory(c.pieces) for c in convs]
        queue = deque(trajs)
        while queue:
            batch = []
            while queue and len(batch) < self.cfg.batch_size:
                t = queue.popleft()
                if self._add_prompt(t):
                    batch.append(t)
                else:
                    on_done(t)
            if not batch:
                break
            caps = [min(self.cfg.max_new_tokens, self.cfg.max_len - len(t.ids)) for t in batch]
            start = time.perf_counter()
            replies = generate_batch(self.model, [t.ids for t in batch], caps, self.eos_ids, self.pad_id,
                                     self.cfg.temperature)
            self.seconds += time.perf_counter() - start
            for t, reply in zip(batch, replies):
                self._add_reply(t, reply)
                self.generated += len(reply)
                if t.done:
                    on_done(t)
                else:
                    queue.append(t)
        return trajs


# ---- 3. write ---------------------------------------------------------------------------------

def _check_resumable(out: Path, cfg: DataConfig) -> dict | None:
    """The folder's earlier meta if this run may resume it; DFlowError if it belongs to another run."""
    old = read_meta(out) if out.is_dir() else None
    if old is None:
        if out.is_dir() and any(out.glob("shard-*.safetensors")):
            raise DFlowError(f"{out} holds shards but no meta.json; use an empty --out")
        return None
    if old["target"]["name"] != cfg.target:
        raise DFlowError(f"{out} holds shards of target {old['target']['name']!r}, not {cfg.target!r}; use another --out")
    diff = [f"{k} {old['settings'].get(k)!r} -> {v!r}" for k, v in cfg.settings().items() if old["settings"].get(k) != v]
    if diff:
        raise DFlowError(f"{out} was built with other settings ({', '.join(diff)}); use another --out")
    return old


def _finished_shards(out: Path, shards: list[list[Planned]]) -> dict[int, dict]:
    """Stats of the shards already on disk, checked to hold the conversations this run plans."""
    stats = {}
    for k, convs in enumerate(shards):
        path = out / shard_name(k)
        if path.exists():
            stats[k], ids = read_shard_metadata(path)
            if ids != [c.id for c in convs]:
                raise DFlowError(f"{path} holds other conversations than this run plans (was the prompt file "
                                 "or the eval set changed?); use another --out")
    return stats


def _meta(cfg: DataConfig, identity: dict, command: str | None, selection: Counter, stats: dict[int, dict],
          num_shards: int) -> dict:
    totals = Counter(dict.fromkeys(STAT_KEYS, 0))
    for s in stats.values():
        totals.update(s)
    generate_s = totals.pop("generate_s", 0.0)
    return {
        "format": FORMAT,
        "target": {"name": cfg.target, **identity},
        "settings": cfg.settings(),
        "batch_size": cfg.batch_size,
        "command": command,
        "counts": {**totals, **selection},
        "generate_s": round(generate_s, 2),
        "generated_tokens_per_s": round(totals["assistant_tokens"] / generate_s, 1) if generate_s else None,
        "shards": [shard_name(k) for k in sorted(stats)],
        "complete": len(stats) == num_shards,
    }


@contextmanager
def _locked(out: Path):
    """Hold an exclusive lock on `out` (processes building one folder with --shard take turns)."""
    with open(out / LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build_dataset(cfg: DataConfig, out: str | Path, command: str | None = None, progress: bool = True) -> dict:
    """Build (or resume) the data folder `out`; returns its final meta.json."""
    out = Path(out)
    old = _check_resumable(out, cfg)
    prompts = sharegpt_file(cfg)
    model, tokenizer = load_target(cfg.target, cfg.dtype)
    if not tokenizer.chat_template:
        raise DFlowError(f"target {cfg.target!r} has no chat template")
    if old is not None:
        check_target(old, out, model, tokenizer)
    if cfg.max_len > getattr(model.config, "max_position_embeddings", cfg.max_len):
        raise DFlowError(f"--max-len {cfg.max_len} exceeds the target's {model.config.max_position_embeddings} positions")
    planned, selection = plan(cfg, tokenizer, prompts)
    if len(planned) < cfg.num_conversations:
        print(f"[dflow] only {len(planned)} usable conversations; writing all of them", file=sys.stderr)
    shards = [planned[i:i + cfg.shard_size] for i in range(0, len(planned), cfg.shard_size)]
    identity = target_identity(model, tokenizer)
    dtype = id_dtype(max(model.config.vocab_size, len(tokenizer)))
    out.mkdir(parents=True, exist_ok=True)

    def update_meta() -> dict:  # from the shards on disk: another --shard process may have added some
        with _locked(out):
            meta = _meta(cfg, identity, command, selection, _finished_shards(out, shards), len(shards))
            write_meta(out, meta)
        return meta

    done = set(update_meta()["shards"])  # checked: each shard on disk holds the conversations planned for it
    mine = [k for k in range(len(shards)) if cfg.shard is None or k % cfg.shard[1] == cfg.shard[0]]
    regen = Regenerator(model, tokenizer, cfg)
    total = sum(len(shards[k]) for k in mine)
    done_before = sum(len(shards[k]) for k in mine if shard_name(k) in done)
    desc = "dflow data" if cfg.shard is None else f"dflow data {cfg.shard[0]}/{cfg.shard[1]}"
    bar = tqdm(total=total, initial=done_before, unit="conv", desc=desc, disable=not progress)

    def finished(_: Trajectory) -> None:
        bar.update(1)
        if regen.seconds:
            bar.set_postfix(gen_tok_s=f"{regen.generated / regen.seconds:.1f}")

    for k in mine:
        if (out / shard_name(k)).exists():  # finished before, or meanwhile by another --shard process
            continue
        convs = shards[k]
        torch.manual_seed(cfg.seed + k)  # a resumed shard samples as an uninterrupted run would
        seconds = regen.seconds
        trajs = regen.run(convs, finished)
        stats = {
            "conversations": len(trajs),
            "tokens": sum(len(t.ids) for t in trajs),
            "assistant_tokens": sum(sum(t.mask) for t in trajs),
            "truncated": sum(t.truncated for t in trajs),
            "unfinished_replies": sum(t.unfinished for t in trajs),
            "generate_s": regen.seconds - seconds,
        }
        write_shard(out / shard_name(k), [(t.ids, t.mask) for t in trajs], dtype, stats, [c.id for c in convs])
        update_meta()
    bar.close()
    return update_meta()
