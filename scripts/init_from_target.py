"""The `b1-last5` ablation of docs/training.md: a drafter whose layers start as copies of target layers
and whose final norm is the target's.

    python scripts/init_from_target.py OUT LAYER_IDS [last]   # e.g. runs/init-last5 25,26,27,28,29

`last`: fc passes the deepest fused layer through (identity) instead of a random init."""
import sys, torch
from dflow.targets import load_target
from dflow.pipeline import init_drafter
from dflow.model import save_drafter
out, ids = sys.argv[1], [int(i) for i in sys.argv[2].split(",")]
fc_mode = sys.argv[3] if len(sys.argv) > 3 else "random"
t, tok = load_target("smollm2-135m", "float32")
d = init_drafter(t, tok, layers=len(ids), relay=False)
with torch.no_grad():
    for dl, i in zip(d.dflash.layers, ids):
        tl = t.model.layers[i]
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(dl.self_attn, name).weight.copy_(getattr(tl.self_attn, name).weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(dl.mlp, name).weight.copy_(getattr(tl.mlp, name).weight)
        dl.input_layernorm.weight.copy_(tl.input_layernorm.weight)
        dl.post_attention_layernorm.weight.copy_(tl.post_attention_layernorm.weight)
    d.dflash.norm.weight.copy_(t.model.norm.weight)
    if fc_mode == "last":  # fc passes the deepest fused layer through
        H = d.cfg.hidden_size; n = len(d.cfg.target_layer_ids)
        d.dflash.fc.weight.zero_(); d.dflash.fc.weight[:, (n - 1) * H:].copy_(torch.eye(H))
save_drafter(d, out)
print("wrote", out, ids, fc_mode, d.cfg.target_layer_ids)
