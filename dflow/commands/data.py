"""`dflow data`: regenerate ShareGPT conversations with the target into a training-data folder."""

from __future__ import annotations

import importlib.util
import sys

from dflow.commands import parse_shard
from dflow.data import DataConfig, build_dataset
from dflow.data.config import ENGINES
from dflow.targets import DEFAULT_TARGET

DEFAULTS = DataConfig()
VLLM_BATCH = 256  # conversations per vLLM request set: enough to keep its continuous batches full


def add_parser(sub) -> None:
    d = sub.add_parser("data", help="build a training set: ShareGPT prompts, the target's own replies")
    d.add_argument("--target", default=DEFAULT_TARGET, help="alias, local HF folder or hub id")
    d.add_argument("--num-conversations", type=int, default=DEFAULTS.num_conversations)
    d.add_argument("--max-len", type=int, default=DEFAULTS.max_len, help="tokens per conversation (cut there)")
    d.add_argument("--max-new-tokens", type=int, default=DEFAULTS.max_new_tokens, help="per assistant turn")
    d.add_argument("--out", required=True, help="data folder; re-running the same command resumes it")
    d.add_argument("--dtype", choices=("float32", "bfloat16"), default=DEFAULTS.dtype)
    d.add_argument("--batch-size", type=int, default=None,
                   help=f"conversations generated together (default: hf {DEFAULTS.batch_size}, vllm {VLLM_BATCH})")
    d.add_argument("--seed", type=int, default=DEFAULTS.seed, help="which conversations (shuffle) and sampling")
    d.add_argument("--temperature", type=float, default=DEFAULTS.temperature, help="0 = greedy (default)")
    d.add_argument("--shard-size", type=int, default=DEFAULTS.shard_size, help="conversations per shard")
    d.add_argument("--sharegpt", default=None, help="a ShareGPT-format JSON file (default: the packaged one)")
    d.add_argument("--engine", choices=("auto",) + ENGINES, default="auto",
                   help="what generates the replies: vllm (continuous batching; the vllm extra) or hf "
                        "(transformers generate); auto = vllm where it is installed")
    d.add_argument("--memory-fraction", type=float, default=None,
                   help="vllm: share of memory it requires free at start (default 0.92): lower it on a busy machine")
    d.add_argument("--kv-cache-gib", type=int, default=DEFAULTS.kv_cache_gib, help="vllm CPU: KV cache size "
                   "(0: let vLLM size it from --memory-fraction)")
    d.add_argument("--cpus", default=None, help="vllm CPU: cores its threads bind to, e.g. 1 or 0-1")
    d.add_argument("--shard", default=None, metavar="K/N",
                   help="build only shards k with k %% N == K, so N processes (e.g. one per core) fill one --out "
                        "together; each reruns the same command with its own K")
    d.set_defaults(func=run_data)


def resolve_engine(name: str) -> str:
    if name != "auto":
        return name
    return "vllm" if importlib.util.find_spec("vllm") is not None else "hf"


def run_data(args) -> int:
    engine = resolve_engine(args.engine)
    batch_size = args.batch_size or (VLLM_BATCH if engine == "vllm" else DEFAULTS.batch_size)
    cfg = DataConfig(target=args.target, num_conversations=args.num_conversations, max_len=args.max_len,
                     max_new_tokens=args.max_new_tokens, dtype=args.dtype, seed=args.seed,
                     temperature=args.temperature, shard_size=args.shard_size, sharegpt=args.sharegpt,
                     engine=engine, batch_size=batch_size, shard=parse_shard(args.shard) if args.shard else None,
                     memory_fraction=args.memory_fraction, kv_cache_gib=args.kv_cache_gib or None, cpus=args.cpus)
    kept = {**cfg.settings(), "batch_size": cfg.batch_size}  # the whole folder's command: no --shard
    command = " ".join(["dflow data", f"--out {args.out}", f"--target {cfg.target}"] +
                       [f"--{k.replace('_', '-')} {v}" for k, v in kept.items() if v is not None])
    meta = build_dataset(cfg, args.out, command)
    c = meta["counts"]
    if args.shard and not meta["complete"]:
        print(f"[dflow] {args.out} holds {len(meta['shards'])} of its shards; the other --shard processes "
              "write the rest (rerun without --shard to finish them here)", file=sys.stderr)
    print(f"wrote {args.out}: {c['conversations']} conversations, {c['tokens']} tokens "
          f"({c['assistant_tokens']} assistant), {c['truncated']} truncated, {c['unfinished_replies']} replies cut "
          f"by --max-new-tokens; passed over: {c['contaminated']} eval-contaminated, {c['malformed']} malformed, "
          f"{c['skipped_no_assistant']} with no room for a reply; {meta['generated_tokens_per_s']} generated tokens/s")
    return 0
