"""`dflow features`: one target pass over a data folder into a feature cache (dflow.train.features)."""

from __future__ import annotations

from dflow.commands import parse_shard
from dflow.drafter import build_target_layer_ids
from dflow.errors import DFlowError
from dflow.model import check_fits_target, load_drafter
from dflow.targets import DEFAULT_TARGET, load_target
from dflow.train.features import STORE_DTYPES, build_features


def add_parser(sub) -> None:
    p = sub.add_parser("features", help="cache the target's context features of a data folder for `dflow train`",
                       description="Run the target once over a `dflow data` folder and store the fused-layer "
                                   "features the drafter reads; `dflow train --feature-cache DIR` then skips the "
                                   "target's context forward. Re-running the same command resumes it.")
    p.add_argument("--target", default=DEFAULT_TARGET, help="alias, local HF folder or hub id")
    p.add_argument("--data", required=True, help="a `dflow data` folder built for this target")
    p.add_argument("--out", default=None, help="cache folder (default: DATA/features-layers-<ids>)")
    layers = p.add_mutually_exclusive_group()
    layers.add_argument("--target-layers", type=int, default=5,
                        help="number of fused target layers, spread as a fresh drafter spreads them (default 5)")
    layers.add_argument("--drafter", default=None, help="take the layer ids of this drafter folder")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the target's weights; must match `dflow train --dtype` (default float32, as there)")
    p.add_argument("--store-dtype", choices=STORE_DTYPES, default="bfloat16",
                   help="dtype of the stored features (default bfloat16); float8: e4m3 with a float32 scale per "
                        "token and layer, half bfloat16's size, read back as float32")
    p.add_argument("--last-state", action="store_true",
                   help="also store the target's final normed state (its logits through the tied head, for KL)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per target forward")
    p.add_argument("--shard", default=None, metavar="K/N", help="build only data shards k with k %% N == K")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.set_defaults(func=run_features)


def run_features(args) -> int:
    model, tokenizer = load_target(args.target, args.dtype)
    if args.drafter is not None:
        cfg = load_drafter(args.drafter).cfg
        check_fits_target(cfg, model.config)
        layer_ids = list(cfg.target_layer_ids)
    elif 1 <= args.target_layers <= model.config.num_hidden_layers:
        layer_ids = build_target_layer_ids(model.config.num_hidden_layers, args.target_layers)
    else:
        raise DFlowError(f"--target-layers must be in 1..{model.config.num_hidden_layers}, got {args.target_layers}")
    summary = build_features(model, tokenizer, args.data, args.out, layer_ids, args.store_dtype, args.last_state,
                             args.batch_size, parse_shard(args.shard) if args.shard else None, args.progress)
    print(f"wrote {summary['folder']}: {summary['shards']} shards ({summary['built']} built now, {summary['kept']} "
          f"kept), {summary['bytes'] / 1e9:.2f} GB; train with --feature-cache {summary['folder']}")
    return 0
