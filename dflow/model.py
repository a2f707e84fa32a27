"""DFlowDrafter = DFlash drafter + (optional) relay, composed; and its checkpoint adapter.

On disk it is a DFlash checkpoint: `config.json` (a Qwen3-style config with `num_target_layers`
and `dflash_config`) and `model.safetensors` with DFlash key names, so the reference package loads
it unchanged. DFlow adds `relay.*` weights and a `dflow_config` entry, which DFlash loaders ignore,
and, for a reduced draft vocabulary only, the map `d2t` (`dflow.vocab`). config.json itself is
`dflow.config_json`'s.
Only safetensors are read: a checkpoint is data, never code (docs/DESIGN.md, "Checkpoint format").
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, replace
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from dflow.config_json import config_json, parse_config
from dflow.drafter import DFlashDrafter, DrafterConfig, build_target_layer_ids
from dflow.errors import DFlowError
from dflow.relay import Relay
from dflow.vocab import MAP_KEY, read_draft_map, to_offsets

MASK_TOKEN_CANDIDATES = ("<|fim_pad|>", "<empty_output>", "<gh_stars>", "<|reserved_special_token_0|>")
WEIGHTS = "model.safetensors"
_TMP = ".dflow-tmp-"  # save_drafter's temporaries inside the destination folder


class DFlowDrafter(nn.Module):
    """The drafter of record: `dflash` (the DFlash drafter) and `relay` (None for DFlash-only)."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        self.dflash = DFlashDrafter(cfg)
        self.relay = Relay(cfg.hidden_size, cfg.relay_hidden_size) if cfg.relay else None

    def init_weights(self, seed: int = 0, std: float = 0.02) -> "DFlowDrafter":
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.dflash.named_parameters():
            with torch.no_grad():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
        if self.relay is not None:
            for m in self.relay.mlp:
                if isinstance(m, nn.Linear):
                    with torch.no_grad():
                        m.weight.copy_(torch.randn(m.weight.shape, generator=gen) * std)
                        m.bias.zero_()
            self.relay.reset_parameters()  # keeps the relay a no-op until trained
        return self


def pick_mask_token_id(target_config, tokenizer=None) -> int:
    """An id the target practically never emits: an unused embedding row, else a rare special."""
    vocab = target_config.vocab_size
    if tokenizer is not None:
        if len(tokenizer) < vocab:
            return len(tokenizer)
        for tok in MASK_TOKEN_CANDIDATES:
            tid = tokenizer.convert_tokens_to_ids(tok)
            if isinstance(tid, int) and tid != tokenizer.unk_token_id and 0 <= tid < vocab:
                return tid
    return vocab - 1


def config_for_target(target_config, num_layers: int = 5, block_size: int = 16, mask_token_id: int | None = None,
                      relay: bool = True, target_layers: int | None = None) -> DrafterConfig:
    """A drafter config sized like the target (width, heads, RoPE) with `num_layers` layers, fusing
    `target_layers` target layers (default: one per drafter layer)."""
    c = target_config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    rope = getattr(c, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))
    return DrafterConfig(
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=head_dim,
        vocab_size=c.vocab_size,
        num_target_layers=c.num_hidden_layers,
        target_layer_ids=tuple(build_target_layer_ids(c.num_hidden_layers, target_layers or num_layers)),
        mask_token_id=c.vocab_size - 1 if mask_token_id is None else mask_token_id,
        block_size=block_size,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=float(theta),
        max_position_embeddings=c.max_position_embeddings,
        relay=relay,
    )


def _holds_drafter(folder: Path) -> bool:
    """config.json (a DFlash drafter config) beside model.safetensors: a drafter's two files."""
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and isinstance(cfg.get("dflash_config"), dict) and (folder / WEIGHTS).is_file()


def check_drafter_destination(out_dir: str | os.PathLike) -> Path:
    """DFlowError unless `out_dir` may receive a drafter: a new path, an empty folder, or a folder
    holding a drafter (whose two files a save replaces; its other files are left alone)."""
    out = Path(out_dir)
    for folder in (out, *out.parents):
        if folder.exists() and not folder.is_dir():
            raise DFlowError(f"{folder} is a file, not a folder: choose another destination for the drafter")
        if folder.exists():
            break
    if out.is_dir() and any(not p.name.startswith(_TMP) for p in out.iterdir()) and not _holds_drafter(out):
        raise DFlowError(f"{out} is not empty and holds no drafter (config.json + model.safetensors): nothing "
                         "was written; choose a new or empty folder")
    return out


def save_drafter(model: DFlowDrafter, out_dir: str | os.PathLike, dtype: torch.dtype | None = None) -> Path:
    """Write config.json + model.safetensors into `out_dir` (see check_drafter_destination). Each
    file is written to a temporary inside `out_dir` and renamed over its old version, so a reader
    never sees a half-written file; nothing else in the folder is touched."""
    out = check_drafter_destination(out_dir)
    dtype = dtype or next(model.parameters()).dtype
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in model.dflash.state_dict().items() if k != MAP_KEY}
    if model.dflash.d2t is not None:  # stored as SpecForge's / vLLM's offsets (dflow.vocab)
        tensors[MAP_KEY] = to_offsets(model.dflash.d2t.detach().cpu().long()).contiguous()
    if model.relay is not None:
        tensors.update({f"relay.{k}": v.detach().to(dtype).contiguous() for k, v in model.relay.state_dict().items()})
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    temps = {name: out / f"{_TMP}{name}" for name in (WEIGHTS, "config.json")}
    try:
        save_file(tensors, str(temps[WEIGHTS]), metadata={"format": "pt"})
        temps["config.json"].write_text(json.dumps(config_json(model.cfg, dtype), indent=2) + "\n")
        for name, tmp in temps.items():  # weights first: both are whole before either is replaced
            os.replace(tmp, out / name)
    finally:
        for tmp in temps.values():
            tmp.unlink(missing_ok=True)
        if created and not any(out.iterdir()):
            out.rmdir()
    return out


def load_drafter(path: str | os.PathLike, dtype: torch.dtype = torch.float32, relay: bool | None = None) -> DFlowDrafter:
    """Load a DFlash or DFlow checkpoint folder. `relay=False` drops relay weights (DFlash mode)."""
    path = Path(path)
    if not path.is_dir():
        raise DFlowError(f"drafter folder {path} does not exist")
    cfg_path, weights = path / "config.json", path / "model.safetensors"
    if not weights.exists():
        pickled = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
        if pickled:
            raise DFlowError(f"{path}: only {pickled[0]} (a pickle) found; DFlow loads safetensors only")
        raise DFlowError(f"{path}: model.safetensors is missing")
    if not cfg_path.exists():
        raise DFlowError(f"{path}: config.json is missing")
    try:
        cfg = parse_config(json.loads(cfg_path.read_text()), cfg_path)
    except json.JSONDecodeError as e:
        raise DFlowError(f"{cfg_path}: not valid JSON ({e})") from e
    try:
        tensors = load_file(str(weights))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise DFlowError(f"{weights}: corrupted or unreadable ({str(e).splitlines()[0]})") from e
    if relay is not None:
        cfg = replace(cfg, relay=relay and cfg.relay)
    model = DFlowDrafter(cfg)
    relay_sd = {k[6:]: v for k, v in tensors.items() if k.startswith("relay.")}
    dflash_sd = {k: v for k, v in tensors.items() if not k.startswith("relay.")}
    if cfg.draft_vocab_size and MAP_KEY not in dflash_sd:
        raise DFlowError(f"{weights}: dflow_config.draft_vocab_size is {cfg.draft_vocab_size}, but no {MAP_KEY} "
                         "map is stored")
    if MAP_KEY in dflash_sd:
        dflash_sd[MAP_KEY] = read_draft_map(dflash_sd[MAP_KEY], cfg.vocab_size, cfg.draft_vocab_size, weights)
    try:
        model.dflash.load_state_dict(dflash_sd, strict=True)
        if model.relay is not None:
            if not relay_sd:
                raise DFlowError(f"{path}: dflow_config says relay but no relay.* weights are stored")
            model.relay.load_state_dict(relay_sd, strict=True)
    except RuntimeError as e:
        raise DFlowError(f"{weights}: weights do not match config.json ({str(e).splitlines()[0]})") from e
    return model.to(dtype).eval()


def check_fits_target(cfg: DrafterConfig, target_config) -> None:
    """One clear error when a drafter was made for another target."""
    problems = []
    if cfg.hidden_size != target_config.hidden_size:
        problems.append(f"hidden size {cfg.hidden_size} != target's {target_config.hidden_size}")
    if cfg.vocab_size != target_config.vocab_size:
        problems.append(f"vocabulary {cfg.vocab_size} != target's {target_config.vocab_size}")
    n = target_config.num_hidden_layers
    if cfg.num_target_layers != n or any(i >= n for i in cfg.target_layer_ids):
        problems.append(f"target layer ids {list(cfg.target_layer_ids)} (of {cfg.num_target_layers} layers) do not fit a {n}-layer target")
    if problems:
        raise DFlowError("drafter does not fit the target: " + "; ".join(problems))


def describe(cfg: DrafterConfig) -> dict:
    return {k: v for k, v in asdict(cfg).items() if k != "extra"}
