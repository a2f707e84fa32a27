"""The trainer's view of a `dflow data` folder: sequences checked against the target, truncated
to --max-len, conversations with nothing to supervise dropped (both counted), and a held-out
slice (the folder's last sequences) for the periodic tau. Reading the shards is `dflow.data`'s."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from dflow.data import open_dataset
from dflow.errors import DFlowError
from dflow.train.batching import anchor_candidates

Example = tuple[torch.Tensor, torch.Tensor]  # (input_ids [T] long, loss_mask [T] bool)


@dataclass
class TrainData:
    train: list[Example]
    held_out: list[Example]
    truncated: int  # sequences cut to max_len
    skipped: int  # sequences with no anchor position (no supervised pair of tokens), left out
    train_source: list[int] = field(default_factory=list)  # index in the data folder of each train example
    held_out_source: list[int] = field(default_factory=list)  # likewise for the held-out ones
    extra: int = 0  # training sequences from --extra-data folders (the last ones of `train`)

    def summary(self) -> str:
        extra = f" ({self.extra} from --extra-data)" if self.extra else ""
        return (f"{len(self.train)} training sequences{extra}, {len(self.held_out)} held out; "
                f"{self.truncated} truncated to --max-len, {self.skipped} skipped (nothing to supervise)")


def prepare(sequences: Sequence[Example], max_len: int, vocab_size: int, held_out: int) -> TrainData:
    """Truncate, drop and split `sequences` (the last `held_out` usable ones are held out)."""
    kept, source, truncated, skipped = [], [], 0, 0
    for i, (ids, mask) in enumerate(sequences):
        if len(ids) and int(ids.max()) >= vocab_size:
            raise DFlowError(f"sequence {i} holds token id {int(ids.max())}, outside the target's vocabulary "
                             f"of {vocab_size}: the data was built for another target")
        if len(ids) > max_len:
            ids, mask, truncated = ids[:max_len], mask[:max_len], truncated + 1
        if not anchor_candidates(mask).any():
            skipped += 1
            continue
        kept.append((ids.long(), mask.bool()))
        source.append(i)
    if len(kept) <= held_out:
        raise DFlowError(f"the data holds {len(kept)} usable sequences ({skipped} had nothing to supervise); "
                         f"need more than the {held_out} held out for evaluation")
    cut = len(kept) - held_out
    return TrainData(kept[:cut], kept[cut:], truncated, skipped, source[:cut], source[cut:])


def load_train_data(folder: str, target, tokenizer, max_len: int, held_out: int,
                    extra: Sequence[str] = ()) -> TrainData:
    """Open `folder` (DFlowError when missing, empty, or built for another target) and prepare it.

    `extra` folders (e.g. the same conversations answered again at a temperature) add training
    sequences only: the held-out slice stays `folder`'s, and an extra sequence from a held-out
    conversation (same ShareGPT id) is left out, so the evaluation stays unseen. Their sequences
    follow `folder`'s in `train`, with no `train_source` (that indexes `folder` alone).
    """
    data = open_dataset(folder, target, tokenizer)
    if len(data) == 0:
        raise DFlowError(f"{folder} holds no sequences")
    out = prepare(data, max_len, target.config.vocab_size, held_out)
    held = {data.source_ids[i] for i in out.held_out_source}
    for more in extra:
        if Path(more).resolve() == Path(folder).resolve():
            raise DFlowError(f"--extra-data {more} is --data itself")
        seqs = open_dataset(more, target, tokenizer)
        keep = [seqs[i] for i, sid in enumerate(seqs.source_ids) if sid not in held]
        if not keep:
            raise DFlowError(f"--extra-data {more} holds no sequences outside --data's held-out conversations")
        add = prepare(keep, max_len, target.config.vocab_size, 0)
        out.train += add.train
        out.truncated += add.truncated
        out.skipped += add.skipped
        out.extra += len(add.train)
    return out


def prompt_of(example: Example) -> list[int]:
    """A held-out sequence's prompt: its tokens before the first supervised one (at least one)."""
    ids, mask = example
    first = int(mask.float().argmax()) if mask.any() else len(ids)
    return ids[: max(1, first)].tolist()
