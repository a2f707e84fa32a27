"""The on-disk training set: safetensors shards plus `meta.json`, and `open_dataset` to read it.

A data folder holds

    meta.json                 format, target fingerprint + vocab hash, settings, command, counts,
                              the finished shards, complete (all planned shards written)
    shard-00000.safetensors   input_ids  [tokens] uint16 (int32 when the vocab has >= 65536 ids)
                              loss_mask  [ceil(tokens / 8)] uint8, np.packbits of the mask
                              offsets    [sequences + 1] int64, sequence i = tokens offsets[i]:offsets[i+1]
                              metadata: "stats" (JSON counts) and "source_ids" (JSON ShareGPT ids)

so a token costs about 2.1 bytes. Every file is written to a temp name and moved into place
(`os.replace`): a shard that exists is finished. The loss mask is True exactly on the tokens the
target generated (its replies, end-of-turn token included).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.numpy import load_file, save

from dflow.errors import DFlowError
from dflow.targets import target_fingerprint

FORMAT = "dflow-data/1"
META = "meta.json"


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def vocab_hash(tokenizer) -> str:
    """A short hash of the tokenizer's token -> id table (added tokens included)."""
    table = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
    return hashlib.sha256(table.encode()).hexdigest()[:16]


def target_identity(model, tokenizer) -> dict:
    """What a data folder records about its target, and what readers compare."""
    return {"fingerprint": target_fingerprint(model), "vocab_hash": vocab_hash(tokenizer)}


def id_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size < 65536 else np.dtype(np.int32)


def _atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to a temp file beside `path`, then move it into place."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_meta(folder: Path, meta: dict) -> None:
    _atomic_write(folder / META, (json.dumps(meta, indent=2) + "\n").encode())


def read_meta(folder: Path) -> dict | None:
    """The folder's meta.json, or None when there is none."""
    path = folder / META
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DFlowError(f"{path} is unreadable: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise DFlowError(f"{path} is not a {FORMAT} data folder")
    return meta


def write_shard(path: Path, sequences: list[tuple[list[int], list[bool]]], dtype: np.dtype,
                stats: dict, source_ids: list[str]) -> None:
    """Write (token ids, loss mask) pairs as one shard, atomically."""
    lengths = [len(ids) for ids, _ in sequences]
    tensors = {
        "input_ids": np.array([t for ids, _ in sequences for t in ids], dtype=dtype),
        "loss_mask": np.packbits(np.array([m for _, mask in sequences for m in mask], dtype=bool)),
        "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
    }
    metadata = {"stats": json.dumps(stats), "source_ids": json.dumps(source_ids)}
    _atomic_write(path, save(tensors, metadata=metadata))


def read_shard_metadata(path: Path) -> tuple[dict, list[str]]:
    """(stats, source_ids) of a finished shard."""
    try:
        with safe_open(str(path), "np") as f:
            metadata = f.metadata() or {}
        return json.loads(metadata["stats"]), json.loads(metadata["source_ids"])
    except (SafetensorError, OSError, KeyError, json.JSONDecodeError) as e:
        raise DFlowError(f"shard {path} is unreadable ({e}); delete it to rebuild it") from e


def check_target(meta: dict, folder: Path, model=None, tokenizer=None) -> None:
    """Raise DFlowError unless the folder's target matches this model / tokenizer."""
    want = meta["target"]
    if model is not None and target_fingerprint(model) != want["fingerprint"]:
        raise DFlowError(f"{folder} was built for another target ({want.get('name')}: {want['fingerprint']}), "
                         f"not this one ({target_fingerprint(model)})")
    if tokenizer is not None and vocab_hash(tokenizer) != want["vocab_hash"]:
        raise DFlowError(f"{folder} was built with another tokenizer (vocab hash {want['vocab_hash']}, "
                         f"this one {vocab_hash(tokenizer)})")


class ShardedDataset(Sequence):
    """Training sequences of a data folder, all in memory: item i = (input_ids, loss_mask).

    input_ids: LongTensor [T]; loss_mask: BoolTensor [T], True on the target's own reply tokens.
    `meta` is the folder's meta.json (counts, settings, target); `lengths` the T of each item;
    `source_ids` the ShareGPT id of each item's conversation.
    """

    def __init__(self, folder: Path, meta: dict):
        self.meta = meta
        ids, masks, offsets, self.source_ids = [], [], [np.zeros(1, np.int64)], []
        for name in meta["shards"]:
            source_ids = read_shard_metadata(folder / name)[1]
            try:
                shard = load_file(str(folder / name))
            except (SafetensorError, OSError) as e:
                raise DFlowError(f"shard {folder / name} is unreadable ({e})") from e
            n = len(shard["input_ids"])
            if shard["offsets"][-1] != n:
                raise DFlowError(f"shard {folder / name} is corrupt (offsets end at {shard['offsets'][-1]}, {n} tokens)")
            ids.append(shard["input_ids"].astype(np.int64))
            masks.append(np.unpackbits(shard["loss_mask"], count=n).astype(bool))
            offsets.append(shard["offsets"][1:] + offsets[-1][-1])
            if len(source_ids) != len(shard["offsets"]) - 1:
                raise DFlowError(f"shard {folder / name} is corrupt ({len(source_ids)} source ids, "
                                 f"{len(shard['offsets']) - 1} sequences)")
            self.source_ids += source_ids
        self._ids = torch.from_numpy(np.concatenate(ids))  # [all tokens]
        self._mask = torch.from_numpy(np.concatenate(masks))  # [all tokens]
        self._offsets = np.concatenate(offsets)  # [items + 1]
        self.lengths = np.diff(self._offsets)  # [items]

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"index {i} out of range for {len(self)} sequences")
        start, end = self._offsets[i % len(self)], self._offsets[i % len(self) + 1]
        return self._ids[start:end], self._mask[start:end]


def open_dataset(folder: str | os.PathLike, target_model=None, tokenizer=None) -> ShardedDataset:
    """Open a `dflow data` folder, checking it against the target (model and/or tokenizer) if given."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DFlowError(f"data folder {folder} does not exist")
    meta = read_meta(folder)
    if meta is None:
        raise DFlowError(f"{folder} holds no training data (no {META}); build it with `dflow data`")
    if not meta["shards"]:
        raise DFlowError(f"{folder} holds no finished shard yet; run `dflow data` again to resume it")
    check_target(meta, folder, target_model, tokenizer)
    return ShardedDataset(folder, meta)
