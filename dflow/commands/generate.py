"""`dflow generate` and `dflow init-drafter`."""

from __future__ import annotations

import argparse
import json
import math
import resource
import sys

from dflow import metrics
from dflow.commands import add_device_arg
from dflow.data import open_dataset
from dflow.drafter import check_block_size
from dflow.errors import DFlowError
from dflow.model import check_drafter_destination, save_drafter
from dflow.pipeline import DEFAULT_LAYERS, DEFAULT_TARGET_LAYERS, Pipeline, draft_vocab_of, init_drafter
from dflow.proposers import METHODS
from dflow.sampling import SamplingParams
from dflow.targets import DEFAULT_TARGET, load_target

COLOURS = ("\033[38;5;39m", "\033[38;5;214m")  # alternating per round
RESET = "\033[0m"


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None, help="reproduce a sampled output")
    p.add_argument("--verify", choices=("rejection", "match"), default="rejection",
                   help="acceptance rule at T > 0 (match: the DFlash reference's sample-and-match)")


def sampling_params(args) -> SamplingParams:
    try:
        return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              rule=args.verify, seed=args.seed)
    except ValueError as e:
        raise DFlowError(str(e)) from e


def add_parser(sub) -> None:
    g = sub.add_parser("generate", help="generate text with ar / dflash / dflow")
    g.add_argument("prompt")
    g.add_argument("--target", default=DEFAULT_TARGET, help="alias, local HF folder or hub id")
    g.add_argument("--drafter", default=None, help="drafter folder (default: the one shipped for the target)")
    g.add_argument("--method", choices=METHODS, default="dflow")
    g.add_argument("--block-size", type=int, default=None, help="default: the drafter's")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    g.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="apply the chat template (default: on when the tokenizer has one)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    add_device_arg(g)
    add_sampling_args(g)
    g.set_defaults(func=run_generate)

    i = sub.add_parser("init-drafter", help="write a freshly initialised drafter (with relay) for a target")
    i.add_argument("--target", default=DEFAULT_TARGET)
    i.add_argument("--layers", type=int, default=DEFAULT_LAYERS, help="drafter layers (default %(default)s)")
    i.add_argument("--block-size", type=int, default=16)
    i.add_argument("--target-layers", type=int, default=None,
                   help=f"target layers fused into the context (default {DEFAULT_TARGET_LAYERS}, or --layers when "
                        "larger, at most the target's)")
    i.add_argument("--out", required=True, help="a new or empty folder, or a drafter folder to replace the "
                                                "drafter in (its other files are kept)")
    i.add_argument("--seed", type=int, default=0)
    i.add_argument("--no-relay", action="store_true", help="a plain DFlash drafter")
    i.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="a reduced draft vocabulary: the N most frequent supervised tokens of --data")
    i.add_argument("--data", default=None, help="the `dflow data` folder --draft-vocab counts over")
    i.set_defaults(func=run_init)


def run_init(args) -> int:
    if (args.draft_vocab is None) != (args.data is None):
        raise DFlowError("--draft-vocab N and --data DIR go together (the N ids are counted over DIR)")
    check_drafter_destination(args.out)  # before the target is loaded
    model, tok = load_target(args.target, "float32")
    examples = open_dataset(args.data, model, tok) if args.data is not None else None
    d2t = draft_vocab_of(examples, model, args.draft_vocab)  # [N] or None
    drafter = init_drafter(model, tok, args.layers, args.block_size, args.seed, relay=not args.no_relay,
                           target_layers=args.target_layers, draft_vocab=d2t)
    save_drafter(drafter, args.out)
    n = sum(p.numel() for p in drafter.parameters())
    vocab = f", draft vocabulary {drafter.cfg.draft_vocab_size}" if drafter.cfg.draft_vocab_size else ""
    print(f"wrote {args.out}: {args.layers} layers, block {args.block_size}, {n / 1e6:.1f}M parameters, "
          f"target layers {list(drafter.cfg.target_layer_ids)}, mask id {drafter.cfg.mask_token_id}{vocab}")
    return 0


class _Streamer:
    """Prints each round's committed chunk in alternating colours (decoding the running text)."""

    def __init__(self, pipe: Pipeline, colour: bool):
        self.pipe, self.colour, self.ids, self.text, self.turn = pipe, colour, [], "", 0

    def __call__(self, new_ids: list[int]) -> None:
        self.ids.extend(new_ids)
        text = self.pipe.decode(self.ids)
        chunk, self.text = text[len(self.text):], text
        if self.colour:
            chunk = f"{COLOURS[self.turn % 2]}{chunk}{RESET}"
        self.turn += 1
        sys.stdout.write(chunk)
        sys.stdout.flush()


def run_generate(args) -> int:
    if args.block_size is not None:
        check_block_size(args.block_size, "--block-size")
    if not args.prompt.strip():
        raise DFlowError("the prompt is empty")
    params = sampling_params(args)
    pipe = Pipeline.load(args.target, args.drafter, args.dtype, need_drafter=args.method != "ar", device=args.device)
    if pipe.fresh_drafter and not args.json:
        print(f"[dflow] {pipe.drafter_note}", file=sys.stderr)
    ids = pipe.encode(args.prompt, args.chat)
    streamer = None if args.json else _Streamer(pipe, sys.stdout.isatty())
    result = pipe.generate(ids, args.method, args.max_new_tokens, args.block_size, params, on_commit=streamer)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if args.json:
        rounds = result.rounds
        print(json.dumps({
            "text": pipe.decode(result.token_ids),
            "token_ids": result.token_ids,
            "num_new_tokens": len(result.token_ids),
            "rounds": len(rounds),
            "tau": _finite(result.tau),
            "accepted": result.accepted,
            "prefill_s": result.prefill_s,
            "decode_s": result.decode_s,
            "tokens_per_s": _finite(result.tokens_per_s),
            "time_split_s": {k: sum(getattr(r, k + "_s") for r in rounds) for k in metrics.STAGES},
            "method": args.method,
            "device": str(pipe.target.device),
            "drafter": pipe.drafter_note,
            "peak_rss_mb": round(peak_mb, 1),
        }))
    else:
        print(f"\n\n[{args.method}] tau {result.tau:.2f} tokens/round | {result.tokens_per_s:.1f} tokens/s decode | "
              f"{len(result.token_ids)} tokens in {len(result.rounds)} rounds | prefill {result.prefill_s * 1000:.0f} ms",
              file=sys.stderr)
    return 0


def _finite(x: float) -> float | None:
    """A metric over no decode round is nan (dflow.metrics); JSON gets null."""
    return x if math.isfinite(x) else None
