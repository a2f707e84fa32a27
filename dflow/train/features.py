"""The feature cache (`dflow features`): the target's context features of a `dflow data` folder,
computed in one target pass and read back by `dflow train --feature-cache DIR`, so that a training
step no longer runs the target's context forward.

A cache folder (default: `DATA/features-layers-1-27`, beside the shards) holds

    features.json             the cache's key: target fingerprint + a digest of its weights, the
                              dtype the target ran in, the layer ids, the stored dtype, last-state flag
    shard-00000.safetensors   one per data shard, its rows aligned with that shard's tokens:
                              features [tokens, n_layers * hidden] the chosen layers' outputs
                                       (`hidden_states[id + 1]`), concatenated as the engine does
                              last     [tokens, hidden] with --last-state: the target's final (normed)
                                       state, whose tied-head logits are the target's (for KL)
                              features_scale [tokens, n_layers], last_scale [tokens, 1]: float8
                                       caches only, float32 scales (below)
                              offsets  [sequences + 1] int64, as in the data shard
                              metadata: data_sha256 (the data shard's hash) and the key

Each shard file is written whole and moved into place, so an interrupted build resumes at the first
missing shard; a shard whose data shard has changed since is rebuilt. Readers refuse a cache whose
key differs from their target / dtype / layer ids (foreign), whose shards' data hashes differ from
the data folder's (stale), or that lacks a shard (unfinished). Reads are memory-mapped
(`safe_open`): only a batch's rows are read.

Stored dtypes: float32, bfloat16 (the default), or float8: e4m3 with one float32 scale per token and
layer (the row's largest magnitude maps to 448, e4m3's largest finite value), read back as float32.
On SmolLM2-135M's 5 fused layers float8 moves the drafter's teacher-forced loss by 0.0005 and its
first-position accuracy not at all, where int8 with the same scales moves the loss 4x as much
(`scripts/probe_feature_precision.py`, docs/training.md "A float8 feature cache").

Size: tokens x (layers [+ 1 with --last-state]) x hidden x 2 bytes in bfloat16, i.e. 1,152 bytes a
token a layer for SmolLM2-135M (hidden 576), 580 in float8 (hidden + a scale). The data set of the
data issue, about 6,000 conversations of up to 1,536 tokens, holds about 2.5M tokens: the 768 conversations of
data/smollm2-135m-sharegpt-3000 average 410.6 tokens, 424.6 if its 21 at the 1,024-token cap are
counted at 1,536. At 2.55M tokens, 5 layers take 14.7 GB (17.6 GB with the last state), 2 layers
5.9 GB. The worst case, every conversation 1,536 tokens long (9.2M tokens), fits in 40 GB with up to
3 layers (31.9 GB; 5 would take 53 GB). The 16K set's 11.4M tokens take 65 GB in bfloat16 and 33 GB in
float8 (5 layers). `dflow features` prints the size before it starts and
refuses when the disk lacks room.

With relay rounds (`--rounds k >= 1`, relay on) the trainer still runs the target over each
trajectory: the packed verifier pass needs the trajectory's KV cache (about 23 KB a token for this
target, too large to store), which that forward makes. The cache then saves nothing and is not
read; it serves DFlash (`--rounds 0`) and `--no-relay` training, where the target's only work was
the context forward.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.numpy import load_file
from safetensors.torch import save
from tqdm import tqdm

from dflow.attention import sdpa_backends
from dflow.data import open_dataset
from dflow.data.shards import _atomic_write, read_meta
from dflow.errors import DFlowError
from dflow.targets import DTYPES, file_sha256, target_fingerprint
from dflow.train.rollout import context_forward

FORMAT = "dflow-features/1"
META = "features.json"
STORE_DTYPES = ("float32", "bfloat16", "float8")
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def quantize_fp8(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., groups * H] -> (float8_e4m3fn [..., groups * H], float32 scales [..., groups]): each group
    of H values (a token's layer) scaled so that its largest magnitude is FP8_MAX."""
    rows = x.float().unflatten(-1, (groups, -1))  # [..., groups, H]
    scale = rows.abs().amax(-1, keepdim=True).clamp(min=1e-30) / FP8_MAX  # [..., groups, 1]
    return (rows / scale).to(torch.float8_e4m3fn).flatten(-2), scale.squeeze(-1)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The inverse of quantize_fp8 (up to its rounding) -> float32 [..., groups * H]."""
    groups = scale.shape[-1]
    return (q.float().unflatten(-1, (groups, -1)) * scale.unsqueeze(-1)).flatten(-2)


def read_dtype(stored: str) -> torch.dtype:
    """The dtype a cache's rows are read back in (float8 ones are dequantized to float32)."""
    return torch.float32 if stored == "float8" else DTYPES[stored]


def bytes_per_token(stored: str, groups: int, hidden: int) -> int:
    """Disk bytes of one token's `groups` rows of `hidden` values (float8: + one float32 scale a row)."""
    return groups * (hidden + 4 if stored == "float8" else hidden * DTYPES[stored].itemsize)


def weights_digest(model) -> str:
    """A short hash of the target's weights (names, shapes, raw bytes): two targets of one
    architecture give different features, so the fingerprint alone does not key a cache."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def cache_key(model, layer_ids, dtype: str, last_state: bool) -> dict:
    """What a cache is keyed by (features.json); `dtype` is the stored one."""
    return {"format": FORMAT, "target": {"fingerprint": target_fingerprint(model), "weights": weights_digest(model),
                                         "dtype": str(model.get_input_embeddings().weight.dtype).split(".")[-1]},
            "layer_ids": [int(i) for i in layer_ids], "dtype": dtype, "last_state": bool(last_state)}


def default_folder(data: str | os.PathLike, layer_ids) -> Path:
    return Path(data) / ("features-layers-" + "-".join(str(i) for i in layer_ids))


def read_key(folder: Path) -> dict:
    try:
        key = json.loads((folder / META).read_text())
    except FileNotFoundError:
        raise DFlowError(f"{folder} is not a feature cache (no {META}); build it with `dflow features`") from None
    except (OSError, json.JSONDecodeError) as e:
        raise DFlowError(f"{folder / META} is unreadable ({e})") from e
    if not isinstance(key, dict) or key.get("format") != FORMAT:
        raise DFlowError(f"{folder} is not a {FORMAT} feature cache")
    return key


def check_key(key: dict, want: dict, folder: Path) -> None:
    """DFlowError unless a cache built with `key` serves a reader expecting `want` (stored dtype and
    last state are the cache's own choice)."""
    have_t, want_t = key["target"], want["target"]
    if have_t["dtype"] != want_t["dtype"]:  # before the weights: their digest is of the loaded dtype's bytes
        raise DFlowError(f"feature cache {folder} was built with the target in {have_t['dtype']}, this run loads it "
                         f"in {want_t['dtype']} (--dtype)")
    if (have_t["fingerprint"], have_t["weights"]) != (want_t["fingerprint"], want_t["weights"]):
        raise DFlowError(f"feature cache {folder} was built for another target ({have_t['fingerprint']}, weights "
                         f"{have_t['weights']}), not this one ({want_t['fingerprint']}, weights {want_t['weights']})")
    if key["layer_ids"] != want["layer_ids"]:
        raise DFlowError(f"feature cache {folder} holds target layers {key['layer_ids']}; this drafter reads "
                         f"{want['layer_ids']} (build another with `dflow features --drafter` or --target-layers)")


@dataclass
class FeatureCache:
    """A cache opened against its data folder: row i = the folder's sequence i (open_dataset order)."""

    folder: Path
    key: dict
    handles: list  # one safe_open per data shard (memory-mapped)
    spans: list[tuple[int, int, int]]  # per sequence: (shard, first row, end row)

    def rows(self, name: str, i: int) -> torch.Tensor:
        """Tensor `name`'s rows of sequence i, in read_dtype (float8 rows dequantized)."""
        shard, start, end = self.spans[i]
        handle = self.handles[shard]
        rows = handle.get_slice(name)[start:end]
        if self.key["dtype"] == "float8":
            return dequantize_fp8(rows, handle.get_slice(name + "_scale")[start:end])
        return rows

    def features(self, i: int) -> torch.Tensor:
        """-> [t, n_layers * hidden] of sequence i."""
        return self.rows("features", i)

    def last(self, i: int) -> torch.Tensor:
        """-> [t, hidden], the target's final normed state (--last-state caches only)."""
        if not self.key["last_state"]:
            raise DFlowError(f"feature cache {self.folder} holds no last state (build it with --last-state)")
        return self.rows("last", i)

    def batch(self, rows: list[int], lengths: list[int], last: bool = False) -> torch.Tensor:
        """Sequences `rows`, cut to `lengths` (a prefix: the target is causal), right-padded with
        zeros -> [b, max(lengths), n_layers * hidden]; with `last` the final state follows the
        features -> [b, max(lengths), (n_layers + 1) * hidden]."""
        width = self.handles[0].get_slice("features").get_shape()[1]
        hidden = width // len(self.key["layer_ids"])
        out = torch.zeros(len(rows), max(lengths), width + hidden * last, dtype=read_dtype(self.key["dtype"]))
        for j, (i, t) in enumerate(zip(rows, lengths)):
            out[j, :t, :width] = self.features(i)[:t]
            if last:
                out[j, :t, width:] = self.last(i)[:t]
        return out


def missing_shards(folder: str | os.PathLike, data: str | os.PathLike) -> list[str]:
    """The data folder's shards (meta.json) that the cache folder has no shard file for."""
    folder, meta = Path(folder), read_meta(Path(data))
    if meta is None:
        raise DFlowError(f"{data} holds no training data (no meta.json)")
    return [n for n in meta["shards"] if not (folder / n).is_file()]


def open_features(folder: str | os.PathLike, data: str | os.PathLike, model, layer_ids) -> FeatureCache:
    """Open a built cache for the data folder `data` and this target / layer ids; DFlowError when
    it is foreign, stale or unfinished."""
    folder, data = Path(folder), Path(data)
    key = read_key(folder)
    check_key(key, cache_key(model, layer_ids, key["dtype"], key["last_state"]), folder)
    missing, shards = missing_shards(folder, data), read_meta(data)["shards"]
    if missing:
        raise DFlowError(f"feature cache {folder} is unfinished ({len(missing)} of {len(shards)} shards missing); "
                         f"run `dflow features --data {data} --out {folder}` again to complete it")
    handles, spans = [], []
    for k, name in enumerate(shards):
        handle, meta = _open_shard(folder / name)
        if meta["data_sha256"] != file_sha256(data / name):
            raise DFlowError(f"feature cache {folder} is stale: {data / name} changed since the cache was built; "
                             f"run `dflow features` again to rebuild it")
        offsets = handle.get_tensor("offsets").tolist()
        spans += [(k, a, b) for a, b in zip(offsets[:-1], offsets[1:])]
        handles.append(handle)
    return FeatureCache(folder, key, handles, spans)


def _open_shard(path: Path):
    try:
        handle = safe_open(str(path), framework="pt")
        return handle, handle.metadata() or {}
    except (SafetensorError, OSError) as e:
        raise DFlowError(f"feature shard {path} is unreadable ({e}); delete it and run `dflow features` again") from e


def _shard_done(path: Path, data_sha: str) -> bool:
    """The shard exists and was built from this data shard."""
    return path.is_file() and _open_shard(path)[1].get("data_sha256") == data_sha


@torch.no_grad()
def shard_features(model, ids: np.ndarray, offsets: np.ndarray, layer_ids, last_state: bool, dtype: str,
                   batch_size: int) -> dict[str, torch.Tensor]:
    """The target over one data shard's sequences (batches of similar length, right-padded) ->
    {"features": [tokens, n_layers * hidden], "last": [tokens, hidden] (last_state)} in the stored
    dtype, and for float8 their scales {"features_scale": [tokens, n_layers], "last_scale": [tokens, 1]}."""
    L, H = model.config.num_hidden_layers, model.config.hidden_size
    wanted = tuple(layer_ids) + ((L - 1,) if last_state else ())  # hidden_states[L]: after the final norm
    fp8 = dtype == "float8"
    rows = torch.empty(int(offsets[-1]), len(wanted) * H, dtype=torch.float8_e4m3fn if fp8 else DTYPES[dtype])
    scales = torch.empty(int(offsets[-1]), len(wanted)) if fp8 else None
    bounds = list(zip(offsets[:-1].tolist(), offsets[1:].tolist()))
    order = sorted(range(len(bounds)), key=lambda i: bounds[i][1] - bounds[i][0])
    device = model.get_input_embeddings().weight.device
    for k in range(0, len(order), batch_size):
        chunk = [bounds[i] for i in order[k:k + batch_size]]
        batch = torch.zeros(len(chunk), max(b - a for a, b in chunk), dtype=torch.long)
        for j, (a, b) in enumerate(chunk):
            batch[j, :b - a] = torch.from_numpy(ids[a:b].astype(np.int64))
        with sdpa_backends(device):
            feats, _ = context_forward(model, batch.to(device), wanted, keep_cache=False)  # [b, T, len(wanted) * H]
        for j, (a, b) in enumerate(chunk):
            if fp8:
                rows[a:b], scales[a:b] = quantize_fp8(feats[j, :b - a], len(wanted))
            else:
                rows[a:b] = feats[j, :b - a].to(rows.dtype)
    n = len(layer_ids)
    out = {"features": rows[:, :n * H].contiguous()}
    if last_state:
        out["last"] = rows[:, n * H:].contiguous()
    if fp8:
        out["features_scale"] = scales[:, :n].contiguous()
        if last_state:
            out["last_scale"] = scales[:, n:].contiguous()
    return out


def build_features(model, tokenizer, data: str | os.PathLike, out: str | os.PathLike | None, layer_ids,
                   dtype: str = "bfloat16", last_state: bool = False, batch_size: int = 4,
                   shard: tuple[int, int] | None = None, progress: bool = True) -> dict:
    """Write (or complete) the cache of data folder `data` -> a summary (folder, shards built and
    kept, tokens, bytes). With `shard=(i, n)` only data shards k % n == i are built, so n processes
    can fill one cache together."""
    if dtype not in STORE_DTYPES:
        raise DFlowError(f"--store-dtype must be one of {', '.join(STORE_DTYPES)}, got {dtype}")
    if batch_size < 1:
        raise DFlowError(f"--batch-size must be >= 1, got {batch_size}")
    data = Path(data)
    dataset = open_dataset(data, model, tokenizer)
    folder = Path(out) if out is not None else default_folder(data, layer_ids)
    key = cache_key(model, layer_ids, dtype, last_state)
    if (folder / META).exists():
        old = read_key(folder)
        if old != key:
            check_key(old, key, folder)
            raise DFlowError(f"{folder} holds a cache stored as {old['dtype']} with last state "
                             f"{old['last_state']}, not {dtype} / {last_state}; use another --out")
    folder.mkdir(parents=True, exist_ok=True)
    _atomic_write(folder / META, (json.dumps(key, indent=2) + "\n").encode())

    names = [n for k, n in enumerate(dataset.meta["shards"]) if shard is None or k % shard[1] == shard[0]]
    todo = []
    for name in names:
        sha = file_sha256(data / name)
        if not _shard_done(folder / name, sha):
            todo.append((name, sha, load_file(str(data / name))))
    width = bytes_per_token(dtype, len(layer_ids) + last_state, model.config.hidden_size)
    tokens = sum(len(t["input_ids"]) for _, _, t in todo)
    free = shutil.disk_usage(folder).free
    if tokens * width > free:
        raise DFlowError(f"the cache needs {tokens * width / 1e9:.1f} GB more, {folder} has {free / 1e9:.1f} GB free")
    print(f"[dflow features] {folder}: {len(names) - len(todo)} of {len(names)} shards done; building "
          f"{len(todo)} ({tokens} tokens, {tokens * width / 1e9:.2f} GB; layers {list(layer_ids)}"
          f"{' + last state' if last_state else ''})", file=sys.stderr, flush=True)
    bar = tqdm(total=tokens, desc="dflow features", unit="tok", disable=not progress)
    for name, sha, tensors in todo:
        rows = shard_features(model, tensors["input_ids"], tensors["offsets"], layer_ids, last_state,
                              dtype, batch_size)
        rows["offsets"] = torch.from_numpy(tensors["offsets"].astype(np.int64))
        _atomic_write(folder / name, save(rows, metadata={"data_sha256": sha, "key": json.dumps(key)}))
        bar.update(len(tensors["input_ids"]))
    bar.close()
    total = sum(os.path.getsize(folder / n) for n in names)
    return {"folder": str(folder), "built": len(todo), "kept": len(names) - len(todo), "shards": len(names),
            "tokens": tokens, "bytes": total}
