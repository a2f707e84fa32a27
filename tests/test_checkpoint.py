"""The drafter's checkpoint is the DFlash layout: it loads in the reference package unchanged."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import tiny_target
from dflow.errors import DFlowError
from dflow.model import DFlowDrafter, check_fits_target, config_for_target, load_drafter, save_drafter
from dflow.proposers import DrafterProposer


def _drafter(target, layers=3, relay=True, block=8):
    return DFlowDrafter(config_for_target(target.config, layers, block, mask_token_id=3, relay=relay)).init_weights(7)


@pytest.mark.parametrize("relay", [False, True])
def test_reference_package_gives_the_same_draft_logits(tmp_path, relay):
    target = tiny_target("qwen3", layers=6)
    assert_reference_logits(target, _drafter(target, relay=relay), tmp_path)


def test_more_fused_target_layers_than_drafter_layers_load_in_the_reference_package(tmp_path):
    target = tiny_target("qwen3", layers=12)
    cfg = config_for_target(target.config, 2, 8, mask_token_id=3, target_layers=5)
    assert cfg.num_hidden_layers == 2 and cfg.target_layer_ids == (1, 3, 5, 7, 9)  # spread over 1..L-3
    assert_reference_logits(target, DFlowDrafter(cfg).init_weights(7), tmp_path)


def assert_reference_logits(target, drafter, tmp_path):
    """The reference package loads the checkpoint and drafts the same logits as our proposer."""
    dflash_model = pytest.importorskip("dflash.model")
    save_drafter(drafter, tmp_path / "d")
    ref = dflash_model.DFlashDraftModel.from_pretrained(str(tmp_path / "d"), dtype=torch.float32).eval()
    assert ref.target_layer_ids == list(drafter.cfg.target_layer_ids)
    assert ref.mask_token_id == 3 and ref.block_size == 8
    ctx_len, block = 11, 8
    feats = torch.randn(1, ctx_len, len(drafter.cfg.target_layer_ids) * 32)  # [1, ctx, n_layers * hidden]
    ids = torch.full((1, block), 3)
    ids[0, 0] = 17
    with torch.inference_mode():
        emb = target.get_input_embeddings()(ids)
        ref_hidden = ref(position_ids=torch.arange(ctx_len + block)[None], noise_embedding=emb, target_hidden=feats)
        ref_logits = ref.compute_logits(ref_hidden[:, 1:], target.lm_head)
        # ours, through the engine's own proposer
        proposer = DrafterProposer(load_drafter(tmp_path / "d"), target, use_relay=False)
        proposer.prefill(proposer.fuse(feats), ctx_len + block)
        ours = proposer.propose(torch.tensor([17]), ctx_len, block)
    torch.testing.assert_close(ours, ref_logits, rtol=1e-5, atol=1e-5)


def test_round_trip_keeps_relay_and_dflash_keys(tmp_path):
    target = tiny_target("llama")
    drafter = _drafter(target)
    with torch.no_grad():
        drafter.relay.mlp[2].weight.normal_()
    save_drafter(drafter, tmp_path / "d", dtype=torch.bfloat16)
    keys = set(load_file(str(tmp_path / "d" / "model.safetensors")))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_proj.weight",
            "layers.0.mlp.gate_proj.weight", "relay.mlp.2.weight"} <= keys
    assert not any(k.startswith(("embed", "lm_head", "dflash.")) for k in keys)
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["dflash_config"]["mask_token_id"] == 3 and cfg["dflow_config"]["relay"] is True
    loaded = load_drafter(tmp_path / "d")
    for (k, a), (_, b) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
        torch.testing.assert_close(a.to(torch.bfloat16).float(), b, msg=k)
    assert load_drafter(tmp_path / "d", relay=False).relay is None


def test_bad_checkpoints_give_one_clear_error(tmp_path):
    target = tiny_target("llama")
    save_drafter(_drafter(target), tmp_path / "ok")
    with pytest.raises(DFlowError, match="does not exist"):
        load_drafter(tmp_path / "missing")
    # pickle only: refused, never unpickled
    (tmp_path / "pickled").mkdir()
    torch.save({"x": torch.zeros(1)}, tmp_path / "pickled" / "pytorch_model.bin")
    with pytest.raises(DFlowError, match="pickle"):
        load_drafter(tmp_path / "pickled")
    # corrupted weights
    bad = tmp_path / "corrupt"
    save_drafter(_drafter(target), bad)
    (bad / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(DFlowError, match="corrupted"):
        load_drafter(bad)
    # weights missing a tensor
    trunc = tmp_path / "trunc"
    save_drafter(_drafter(target), trunc)
    sd = load_file(str(trunc / "model.safetensors"))
    sd.pop("fc.weight")
    save_file(sd, str(trunc / "model.safetensors"))
    with pytest.raises(DFlowError, match="do not match"):
        load_drafter(trunc)
    # broken config
    (tmp_path / "ok" / "config.json").write_text("{not json")
    with pytest.raises(DFlowError, match="JSON"):
        load_drafter(tmp_path / "ok")


def test_drafter_for_another_target_is_refused():
    small, other = tiny_target("llama", layers=4), tiny_target("llama", layers=4, vocab=80)
    cfg = _drafter(small).cfg
    check_fits_target(cfg, small.config)
    with pytest.raises(DFlowError, match="vocabulary"):
        check_fits_target(cfg, other.config)
    wide = tiny_target("qwen3", layers=2)
    with pytest.raises(DFlowError, match="layer ids"):
        check_fits_target(cfg, wide.config)


def test_untrained_relay_is_a_no_op():
    """A DFlow drafter with an untrained relay behaves exactly as DFlash."""
    target = tiny_target("llama")
    drafter = _drafter(target)
    p_on, p_off = DrafterProposer(drafter, target, True), DrafterProposer(drafter, target, False)
    feats = torch.randn(1, 5, 3 * 32)
    with torch.inference_mode():
        for p in (p_on, p_off):
            p.prefill(p.fuse(feats), 16)
            p.relay_rejected(p.fuse(torch.randn(1, 8, 3 * 32)), torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]]), torch.tensor([3]),
                             torch.tensor([5]))
        torch.testing.assert_close(p_on.propose(torch.tensor([9]), 5, 8), p_off.propose(torch.tensor([9]), 5, 8),
                                   rtol=0, atol=0)


@pytest.mark.parametrize("key, value, message", [
    ("num_hidden_layers", "two", "num_hidden_layers must be an integer"),
    ("num_attention_heads", 4.5, "num_attention_heads must be an integer"),
    ("hidden_size", True, "hidden_size must be an integer"),
    ("vocab_size", "64", "vocab_size must be an integer"),
    ("num_key_value_heads", 0, "num_key_value_heads must be an integer >= 1"),
    ("head_dim", "8", "head_dim must be an integer"),
    ("rms_norm_eps", "1e-6", "rms_norm_eps must be a positive number"),
    ("rope_theta", -1, "rope_theta must be a positive number"),
    ("dflash_config.mask_token_id", "3", "dflash_config.mask_token_id must be an integer"),
    ("dflash_config.mask_token_id", 64, "mask_token_id 64 is outside the vocabulary"),
    ("dflash_config.block_size", 8.0, "dflash_config.block_size must be an integer"),
    ("dflash_config.target_layer_ids", "0,1", "target_layer_ids must be a non-empty list"),
    ("dflash_config.target_layer_ids", [0, "1"], "target_layer_ids must be an integer"),
    ("dflow_config.relay", "yes", "dflow_config.relay must be true or false"),
    ("dflow_config", ["relay"], "dflow_config must be an object"),
    ("rope_parameters", "default", "rope_parameters must be an object"),
])
def test_wrong_typed_config_values_name_the_field(tmp_path, key, value, message):
    save_drafter(_drafter(tiny_target("llama")), tmp_path / "d")
    path = tmp_path / "d" / "config.json"
    cfg = json.loads(path.read_text())
    *outer, last = key.split(".")
    (cfg[outer[0]] if outer else cfg)[last] = value
    path.write_text(json.dumps(cfg))
    with pytest.raises(DFlowError, match=message):
        load_drafter(tmp_path / "d")


def test_float_fields_take_integers_and_head_dim_may_be_null(tmp_path):
    save_drafter(_drafter(tiny_target("llama")), tmp_path / "d")
    path = tmp_path / "d" / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(rms_norm_eps=1, rope_theta=10000, head_dim=None)
    cfg.pop("rope_parameters")
    path.write_text(json.dumps(cfg))
    loaded = load_drafter(tmp_path / "d").cfg
    assert loaded.rms_norm_eps == 1.0 and loaded.rope_theta == 10000.0 and loaded.head_dim == 32 // 4
