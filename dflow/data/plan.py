"""Step 1 of `dflow data`, the plan: which ShareGPT conversations a run regenerates, in what order.

Stream ShareGPT, shuffle it with the seed, walk it until `num_conversations` are chosen; malformed
records, conversations whose first user turn is an evaluation prompt and ones whose first prompt
already fills `max_len` are counted and passed over. Each chosen conversation is kept as the chat
template's text before each of its assistant turns.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from jinja2.exceptions import TemplateError

from dflow.data.config import DataConfig
from dflow.data.sharegpt import iter_json_array, packaged_sharegpt, to_conversation
from dflow.datasets import eval_prompt_texts, normalize_text
from dflow.errors import DFlowError

SENTINEL = "<<dflow-reply-{}>>"  # stands in for reply k when rendering the chat template
CONTAINMENT_MIN_CHARS = 64  # eval prompts this long are also dropped when found inside a user turn


@dataclass
class Planned:
    id: str  # ShareGPT id
    pieces: list[str]  # template text before reply k, for each user turn k


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
