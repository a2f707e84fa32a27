"""Where does a block's index 1 look? The attention mass of the drafter's index-1 queries, per layer.

    python scripts/probe_attention.py --drafter RUN [--data runs/ablate-data] [--held-out 24] [--anchors 64]

On the last --held-out sequences of the data (as `dflow train --eval-samples N` holds them out),
for up to --anchors anchors each, it runs the drafter one block at a time (context < s, the block
[y_s, mask, ...]) and prints, per layer and averaged over heads and blocks, the attention mass of
the index-1 query on the anchor (block index 0), on the last context position s-1, on position 0
(the target's attention sink, whose features are outliers), on the other context positions, and on the other block positions, beside the uniform share 1/(s + B). Index 1
can predict y_{s+1} only from what it attends to: mass near uniform means the drafter has not
learned to route the anchor or the recent context to its first draft position.
"""

from __future__ import annotations

import argparse

import torch

from dflow.model import check_fits_target, load_drafter
from dflow.targets import DEFAULT_TARGET, load_target
from dflow.train.batching import anchor_candidates
from dflow.train.dataset import load_train_data
from dflow.train.rollout import context_forward


@torch.no_grad()
def index1_mass(drafter, target, ids: torch.Tensor, anchors: list[int]) -> torch.Tensor:
    """ids [T] one sequence; anchors: positions s -> [layers, 6] mean mass (anchor, s-1, position 0, other context,
    other block, uniform share)."""
    d, cfg = drafter.dflash, drafter.cfg
    B = cfg.block_size
    features, _ = context_forward(target, ids[None], cfg.target_layer_ids, keep_cache=False)  # [1, T, F]
    ctx = d.project(features)  # [1, T, hidden]
    ctx_kv = d.context_kv(ctx, torch.arange(ids.shape[0])[None])
    embed = target.get_input_embeddings()
    out = torch.zeros(cfg.num_hidden_layers, 6)
    for s in anchors:
        block = torch.full((1, B), cfg.mask_token_id)
        block[0, 0] = ids[s]
        x = embed(block)  # [1, B, hidden]
        cos, sin = d.rope(torch.arange(s, s + B)[None], x.dtype)
        for i, layer in enumerate(d.layers):
            q, k, v = layer.before_attention(x, cos, sin)  # q [1, heads, B, hd]; k, v [1, kv, B, hd]
            ck, cv = ctx_kv[i][0][:, :, :s], ctx_kv[i][1][:, :, :s]
            keys = torch.cat([ck, k], 2).repeat_interleave(cfg.num_attention_heads // cfg.num_key_value_heads, 1)
            p = torch.softmax(q[:, :, 1:2] @ keys.transpose(-1, -2) / cfg.head_dim ** 0.5, -1)[0, :, 0]  # [heads, s+B]
            out[i] += torch.stack([p[:, s].mean(), p[:, s - 1].mean(), p[:, 0].mean(), p[:, 1:s - 1].sum(-1).mean(),
                                   p[:, s + 1:].sum(-1).mean(), torch.tensor(1.0 / (s + B))])
            x = layer(x, cos, sin, ck, cv)
    return out / len(anchors)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--drafter", required=True)
    p.add_argument("--data", default="runs/ablate-data")
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--held-out", type=int, default=24)
    p.add_argument("--sequences", type=int, default=6)
    p.add_argument("--anchors", type=int, default=32, help="anchors per sequence (evenly spread)")
    args = p.parse_args()
    target, tokenizer = load_target(args.target, "float32")
    drafter = load_drafter(args.drafter)
    check_fits_target(drafter.cfg, target.config)
    data = load_train_data(args.data, target, tokenizer, 1536, args.held_out)
    total = torch.zeros(drafter.cfg.num_hidden_layers, 6)
    for ids, mask in data.held_out[:args.sequences]:
        cand = anchor_candidates(mask).nonzero()[:, 0].tolist()
        step = max(1, len(cand) // args.anchors)
        total += index1_mass(drafter, target, ids, cand[::step][:args.anchors])
    total /= args.sequences
    print(f"{args.drafter}: index-1 attention mass, mean over heads and {args.sequences} x <= {args.anchors} held-out blocks")
    print("layer  anchor  ctx s-1  ctx 0  other ctx  other block  uniform share")
    for i, row in enumerate(total.tolist()):
        print(f"{i:5d}  {row[0]:.3f}   {row[1]:.3f}    {row[2]:.3f}  {row[3]:.3f}      {row[4]:.3f}        {row[5]:.4f}")


if __name__ == "__main__":
    main()
