"""config.json <-> DrafterConfig: the DFlash reference's Qwen3-style config with `dflash_config`,
plus DFlow's `dflow_config` (docs/DESIGN.md, "Checkpoint format"). Unknown DFlash keys are kept
(DrafterConfig.extra); unknown `dflow_config` keys and badly typed values are one DFlowError each."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from dflow.drafter import DrafterConfig
from dflow.errors import DFlowError

# config.json keys of the DFlash layout that carry nothing we need (kept out of DrafterConfig)
_IGNORED_KEYS = {
    "architectures", "model_type", "hidden_act", "attention_bias", "attention_dropout", "torch_dtype",
    "dtype", "transformers_version", "tie_word_embeddings", "use_cache", "initializer_range",
    "rope_scaling", "rope_parameters", "layer_types", "use_sliding_window", "sliding_window",
    "max_window_layers", "bos_token_id", "eos_token_id", "pad_token_id", "auto_map", "block_size",
}
_DFLOW_KEYS = {"relay", "relay_hidden_size", "version", "draft_vocab_size"}
def config_json(cfg: DrafterConfig, dtype: torch.dtype) -> dict:
    d = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": cfg.max_position_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "dtype": str(dtype).removeprefix("torch."),
        "num_target_layers": cfg.num_target_layers,
        "block_size": cfg.block_size,
        "dflash_config": {
            "target_layer_ids": list(cfg.target_layer_ids),
            "block_size": cfg.block_size,
            "mask_token_id": cfg.mask_token_id,
        },
    }
    d.update(cfg.extra)
    # a full-vocabulary DFlash drafter gets no dflow_config: the reference's layout, key for key
    if cfg.relay or cfg.draft_vocab_size:
        d["dflow_config"] = {"version": 1, "relay": cfg.relay, "relay_hidden_size": cfg.relay_hidden_size}
    if cfg.draft_vocab_size:
        d["dflow_config"]["draft_vocab_size"] = cfg.draft_vocab_size
    return d


def _typed(path: Path, name: str, value, kind: type, low: int = 1):
    """The value of config field `name` if it has the right type, else one DFlowError naming the
    field. int: an integer >= `low` (not a bool, a float or a string); float: a positive number
    (integers too); bool: true or false."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not {bool: isinstance(value, bool), int: number and isinstance(value, int) and value >= low,
            float: number and math.isfinite(value) and value > 0}[kind]:
        want = {bool: "true or false", int: f"an integer >= {low}", float: "a positive number"}[kind]
        raise DFlowError(f"{path}: {name} must be {want}, got {json.dumps(value)}")
    return float(value) if kind is float else value


_INT_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "vocab_size", "num_target_layers", "max_position_embeddings")


def parse_config(d: dict, path: Path) -> DrafterConfig:
    if not isinstance(d, dict):
        raise DFlowError(f"{path}: not a drafter config (a JSON object)")
    d = dict(d)
    dflash = d.pop("dflash_config", None)
    if not isinstance(dflash, dict) or not {"target_layer_ids", "mask_token_id"} <= set(dflash):
        raise DFlowError(f"{path}: not a DFlash drafter config (dflash_config.target_layer_ids / mask_token_id missing)")
    dflow, rope = d.pop("dflow_config", None) or {}, d.get("rope_parameters") or {}
    for name, value in (("dflow_config", dflow), ("rope_parameters", rope)):
        if not isinstance(value, dict):
            raise DFlowError(f"{path}: {name} must be an object, got {json.dumps(value)}")
    unknown = set(dflow) - _DFLOW_KEYS
    if unknown:
        raise DFlowError(f"{path}: unknown dflow_config keys {sorted(unknown)}")
    missing = {*_INT_FIELDS, "rms_norm_eps"} - set(d)
    if missing:
        raise DFlowError(f"{path}: config.json lacks {sorted(missing)}")
    kwargs = {k: _typed(path, k, d.pop(k), int) for k in _INT_FIELDS}
    head_dim = d.pop("head_dim", None)
    kwargs["head_dim"] = (kwargs["hidden_size"] // kwargs["num_attention_heads"] if head_dim is None
                          else _typed(path, "head_dim", head_dim, int))
    ids = dflash["target_layer_ids"]
    if not isinstance(ids, list) or not ids:
        raise DFlowError(f"{path}: dflash_config.target_layer_ids must be a non-empty list, got {json.dumps(ids)}")
    ids = tuple(_typed(path, "dflash_config.target_layer_ids", i, int, low=0) for i in ids)
    kwargs["rms_norm_eps"] = _typed(path, "rms_norm_eps", d.pop("rms_norm_eps"), float)
    theta = d.pop("rope_theta", None) or rope.get("rope_theta", 1_000_000.0)
    extra = {k: v for k, v in d.items() if k not in _IGNORED_KEYS}
    try:
        return DrafterConfig(
            **kwargs,
            target_layer_ids=ids,
            mask_token_id=_typed(path, "dflash_config.mask_token_id", dflash["mask_token_id"], int, low=0),
            block_size=_typed(path, "dflash_config.block_size", dflash.get("block_size", d.get("block_size", 16)), int),
            rope_theta=_typed(path, "rope_theta", theta, float),
            relay=_typed(path, "dflow_config.relay", dflow.get("relay", False), bool),
            relay_hidden_size=_typed(path, "dflow_config.relay_hidden_size", dflow.get("relay_hidden_size", 0), int, 0),
            draft_vocab_size=_typed(path, "dflow_config.draft_vocab_size", dflow.get("draft_vocab_size", 0), int, 0),
            extra=extra,
        )
    except (TypeError, ValueError) as e:  # DrafterConfig's own checks (ranges, head counts)
        raise DFlowError(f"{path}: bad drafter config: {e}") from e
