"""Would a feature cache stored in fewer bits still train the drafter it serves? The drafter's
teacher-forced loss, first-position accuracy and accepted length on the same training blocks, with
the target's float32 context features as they are and rounded to each stored format.

    OMP_NUM_THREADS=1 taskset -c 1 python scripts/probe_feature_precision.py results/base-2k3 \
        --data data/smollm2-135m-sharegpt-16k --sequences 24 [--json out.json]

A full float32 or bfloat16 cache of a large data set may not fit the disk (1,152 bytes a token a layer
in bfloat16 for SmolLM2-135M); float8 (e4m3, one scale per token and layer) halves that. The
formats are compared by what the drafter makes of them: if its statistics on rounded features match
those on the exact ones within a small fraction of what a stretch of training moves them, training
on the rounded features is training on the same inputs. The relative error |rounded - exact| / |exact|
of the features is printed beside them.
"""

from __future__ import annotations

import argparse
import json

import torch

from dflow.model import load_drafter
from dflow.targets import DEFAULT_TARGET, load_target
from dflow.train.batching import collate, sample_anchors
from dflow.train.dataset import load_train_data
from dflow.train.features import dequantize_fp8, quantize_fp8
from dflow.train.logs import step_record
from dflow.train.rollout import Rollout, TargetParts, context_forward



def to_int8(features: torch.Tensor, n_layers: int) -> torch.Tensor:
    """Round-trip through int8 with one absmax scale per token and layer ([b, T, n_layers * H])."""
    x = features.unflatten(-1, (n_layers, -1))  # [b, T, n_layers, H]
    scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127
    return ((x / scale).round().clamp(-127, 127) * scale).flatten(-2)


FORMATS = {
    "float32": lambda f, n: f,
    "bfloat16": lambda f, n: f.to(torch.bfloat16).float(),
    "float8 e4m3 (scale per token, layer)": lambda f, n: dequantize_fp8(*quantize_fp8(f, n)),  # `dflow features`' float8
    "int8 (absmax per token, layer)": to_int8,
}


@torch.no_grad()
def probe(target, drafter, data, sequences: int, batch_size: int, anchors: int, seed: int) -> dict[str, dict]:
    """-> per format: the drafter's step statistics over the same blocks, and the features' relative error."""
    rollout = Rollout(drafter, TargetParts(target, drafter.cfg.target_layer_ids), 0, False, compile=False, loss_gamma=1.0)
    n_layers = len(drafter.cfg.target_layer_ids)
    gen = torch.Generator().manual_seed(seed)
    picks = torch.randperm(len(data), generator=gen)[:sequences].tolist()
    stats = {name: [] for name in FORMATS}
    err = {name: [0.0, 0.0] for name in FORMATS}  # sum |rounded - exact|^2, sum |exact|^2
    peak, top4 = [], []  # per (token, layer) row: absmax / rms, share of |row|^2 in its 4 largest values
    for i in range(0, len(picks), batch_size):
        seqs = [data[j] for j in picks[i:i + batch_size]]
        draws = [sample_anchors(mask, anchors, torch.Generator().manual_seed(seed * 7919 + i * 101 + k))
                 for k, (_, mask) in enumerate(seqs)]
        batch = collate(seqs, draws)
        exact, _ = context_forward(target, batch.ids, drafter.cfg.target_layer_ids, keep_cache=False)
        exact = exact.float()
        real = torch.cat([exact[j, :n] for j, n in enumerate(batch.lengths.tolist())]).unflatten(-1, (n_layers, -1))
        sq = real.square()
        peak.append((real.abs().amax(-1) / sq.mean(-1).sqrt().clamp(min=1e-30)).flatten())
        top4.append((sq.topk(4, -1).values.sum(-1) / sq.sum(-1).clamp(min=1e-30)).flatten())
        for name, fmt in FORMATS.items():
            rounded = fmt(exact, n_layers)
            err[name][0] += float((rounded - exact).square().sum())
            err[name][1] += float(exact.square().sum())
            _, s = rollout(batch, rounded, None)
            stats[name].append(s.cpu())
        print(f"sequences {min(i + batch_size, len(picks))}/{len(picks)}", flush=True)
    out = {"rows": {"absmax_over_rms_median": float(torch.cat(peak).median()),
                    "top4_share_median": float(torch.cat(top4).median())}}
    for name in FORMATS:
        rec = step_record(1, 0.0, stats[name], 0.0, 0, 1.0)
        out[name] = {"rel_error": (err[name][0] / err[name][1]) ** 0.5, "loss": rec["loss_r0"],
                     "acc1": rec["acc1_r0"], "accepted": rec["accepted_r0"], "blocks": rec["anchors_r0"]}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("drafter")
    p.add_argument("--data", required=True)
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--sequences", type=int, default=24, help="training sequences drawn at random")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--anchors", type=int, default=256, help="anchors a sequence, drawn as `dflow train` draws them")
    p.add_argument("--dtype", default="float32", help="the target's dtype (the exact features)")
    p.add_argument("--max-len", type=int, default=1536)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.sequences < 1 or args.batch_size < 1 or args.anchors < 1:
        p.error("--sequences, --batch-size and --anchors must be >= 1")

    target, tokenizer = load_target(args.target, args.dtype, torch.device("cpu"))
    data = load_train_data(args.data, target, tokenizer, args.max_len, 24).train  # held-out slice as `dflow train`'s
    drafter = load_drafter(args.drafter).eval()
    rows = probe(target, drafter, data, args.sequences, args.batch_size, args.anchors, args.seed)
    shape = rows.pop("rows")
    ref = rows["float32"]
    print(f"\n{args.sequences} training sequences, {args.anchors} anchors each ({ref['blocks']} blocks), "
          f"{args.drafter}, target in {args.dtype}")
    print("| stored as | bytes a token a layer | feature rel. error | loss | d loss | acc1 | d acc1 | accepted | d accepted |")
    print("|---|---|---|---|---|---|---|---|---|")
    hidden = target.config.hidden_size
    size = {"float32": 4 * hidden, "bfloat16": 2 * hidden}
    for name, r in rows.items():
        b = size.get(name, hidden + 4)
        print(f"| {name} | {b:,} | {r['rel_error']:.2e} | {r['loss']:.4f} | {r['loss'] - ref['loss']:+.4f} "
              f"| {r['acc1']:.4f} | {r['acc1'] - ref['acc1']:+.4f} | {r['accepted']:.4f} "
              f"| {r['accepted'] - ref['accepted']:+.4f} |")
    print(f"the features' rows (a token's layer): median absmax / rms {shape['absmax_over_rms_median']:.1f} "
          f"(about 3.5 for {hidden} Gaussian values), median share of the squared norm in the 4 largest values "
          f"{shape['top4_share_median']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": vars(args), "rows": rows, "row_shape": shape}, f, indent=2)


if __name__ == "__main__":
    main()
