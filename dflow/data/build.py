"""`dflow data`: build a training set whose assistant turns are the target's own replies.

1. Plan (`dflow.data.plan`): the seeded choice of ShareGPT conversations, eval prompts filtered out.
2. Regenerate (`dflow.data.regenerate`, `dflow.data.vllm_engine`): the target answers each user turn,
   with HF `generate` (`--engine hf`) or vLLM's offline `LLM` (`--engine vllm`).
3. Write (here): shard k (conversations k*S .. k*S+S-1 of the plan) atomically; an existing shard is
   kept, so re-running the same command resumes, and re-running it with a larger
   `--num-conversations` extends the folder (the plan's first shards are unchanged). With `shard=(i, n)` a process builds only the
   shards k with k % n == i, so n processes fill one folder together; meta.json is rewritten under
   a file lock from the shards on disk, so it lists every process's shards.

The token sequence is exactly what the target read and wrote: template pieces are tokenized
between the replies, and the replies stay the generated ids (never decoded and re-tokenized).
"""

from __future__ import annotations

import fcntl
import sys
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

from tqdm import tqdm

from dflow.data.config import DataConfig
from dflow.data.plan import Planned, plan, sharegpt_file
from dflow.data.regenerate import HFRegenerator, Trajectory, end_token_ids
from dflow.data.shards import (FORMAT, check_target, id_dtype, read_meta, read_shard_metadata, shard_name,
                               target_identity, write_meta, write_shard)
from dflow.errors import DFlowError
from dflow.targets import load_target, resolve_target

LOCK = ".lock"  # taken while meta.json is rewritten
STAT_KEYS = ("conversations", "tokens", "assistant_tokens", "truncated", "unfinished_replies", "generate_s", "wall_s")

__all__ = ["DataConfig", "build_dataset"]


def _check_resumable(out: Path, cfg: DataConfig) -> dict | None:
    """The folder's earlier meta if this run may resume it; DFlowError if it belongs to another run."""
    old = read_meta(out) if out.is_dir() else None
    if old is None:
        if out.is_dir() and any(out.glob("shard-*.safetensors")):
            raise DFlowError(f"{out} holds shards but no meta.json; use an empty --out")
        return None
    if old["target"]["name"] != cfg.target:
        raise DFlowError(f"{out} holds shards of target {old['target']['name']!r}, not {cfg.target!r}; use another --out")
    before = {"engine": "hf", **old["settings"]}  # folders from before --engine were built by hf
    diff = [f"{k} {before.get(k)!r} -> {v!r}" for k, v in cfg.settings().items()
            if before.get(k) != v and not (k == "num_conversations" and _grows(before, cfg))]
    if diff:
        raise DFlowError(f"{out} was built with other settings ({', '.join(diff)}); use another --out")
    return old


def _grows(before: dict, cfg: DataConfig) -> bool:
    """A larger --num-conversations extends a folder: the plan is a prefix-stable walk of the seeded
    shuffle, so its shards so far are the first shards of the larger plan. Only whole shards are
    prefixes: a folder whose last shard is short cannot grow (DFlowError)."""
    old_n = before["num_conversations"]
    if cfg.num_conversations <= old_n:
        return False
    if old_n % cfg.shard_size:
        raise DFlowError(f"--num-conversations {old_n} -> {cfg.num_conversations}: the folder's last shard is short "
                         f"({old_n} is not a multiple of --shard-size {cfg.shard_size}), so it cannot grow; "
                         "use another --out")
    return True


def _finished_shards(out: Path, shards: list[list[Planned]]) -> dict[int, dict]:
    """Stats of the shards already on disk, checked to hold the conversations this run plans."""
    stats = {}
    for k, convs in enumerate(shards):
        path = out / shard_name(k)
        if path.exists():
            stats[k], ids = read_shard_metadata(path)
            if ids != [c.id for c in convs]:
                raise DFlowError(f"{path} holds other conversations than this run plans (was the prompt file "
                                 "or the eval set changed?); use another --out")
    return stats


def _meta(cfg: DataConfig, identity: dict, engine: dict, command: str | None, selection: Counter,
          stats: dict[int, dict], num_shards: int) -> dict:
    totals = Counter(dict.fromkeys(STAT_KEYS, 0))
    for s in stats.values():
        totals.update(s)
    generate_s, wall_s = totals.pop("generate_s", 0.0), totals.pop("wall_s", 0.0)
    return {
        "format": FORMAT,
        "target": {"name": cfg.target, **identity},
        "settings": cfg.settings(),
        "engine": engine,
        "batch_size": cfg.batch_size,
        "command": command,
        "counts": {**totals, **selection},
        "generate_s": round(generate_s, 2),
        "wall_s": round(wall_s, 2),  # building the finished shards, engine start-up excluded
        "generated_tokens_per_s": round(totals["assistant_tokens"] / generate_s, 1) if generate_s else None,
        "shards": [shard_name(k) for k in sorted(stats)],
        "complete": len(stats) == num_shards,
    }


@contextmanager
def _locked(out: Path):
    """Hold an exclusive lock on `out` (processes building one folder with --shard take turns)."""
    with open(out / LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _shard_stats(trajs: list[Trajectory], generate_s: float, wall_s: float) -> dict:
    return {
        "conversations": len(trajs),
        "tokens": sum(len(t.ids) for t in trajs),
        "assistant_tokens": sum(sum(t.mask) for t in trajs),
        "truncated": sum(t.truncated for t in trajs),
        "unfinished_replies": sum(t.unfinished for t in trajs),
        "generate_s": generate_s,
        "wall_s": wall_s,
    }


def _engine_record(cfg: DataConfig) -> dict:
    """What meta.json says generated the replies."""
    if cfg.engine == "hf":
        import transformers

        return {"name": "hf", "version": transformers.__version__}
    from dflow.data.vllm_engine import vllm_version

    return {"name": "vllm", "version": vllm_version()}


def _engine(cfg: DataConfig, model, tokenizer, eos_ids: set[int], progress: bool, llm):
    """(regenerator, the vLLM engine to shut down or None)."""
    if cfg.engine == "hf":
        return HFRegenerator(model, tokenizer, eos_ids, cfg), None
    from dflow.data.vllm_engine import VllmRegenerator, start_engine

    own = llm is None
    llm = start_engine(resolve_target(cfg.target), cfg) if own else llm
    return VllmRegenerator(llm, tokenizer, eos_ids, cfg, progress), llm if own else None


def build_dataset(cfg: DataConfig, out: str | Path, command: str | None = None, progress: bool = True,
                  llm=None) -> dict:
    """Build (or resume) the data folder `out`; returns its final meta.json. `llm`: an already
    started `vllm.LLM` for the target (`--engine vllm` only; the caller shuts it down)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise DFlowError(f"--out {out} is a file, not a data folder; name a new or existing data folder")
    old = _check_resumable(out, cfg)
    prompts = sharegpt_file(cfg)
    if cfg.engine == "vllm":
        from dflow.data.vllm_engine import require_vllm

        require_vllm()  # before anything slow
    model, tokenizer = load_target(cfg.target, cfg.dtype)
    if not tokenizer.chat_template:
        raise DFlowError(f"target {cfg.target!r} has no chat template")
    if old is not None:
        check_target(old, out, model, tokenizer)
    if cfg.max_len > getattr(model.config, "max_position_embeddings", cfg.max_len):
        raise DFlowError(f"--max-len {cfg.max_len} exceeds the target's {model.config.max_position_embeddings} positions")
    planned, selection = plan(cfg, tokenizer, prompts)
    if len(planned) < cfg.num_conversations:
        print(f"[dflow] only {len(planned)} usable conversations; writing all of them", file=sys.stderr)
    shards = [planned[i:i + cfg.shard_size] for i in range(0, len(planned), cfg.shard_size)]
    identity = target_identity(model, tokenizer)
    dtype = id_dtype(max(model.config.vocab_size, len(tokenizer)))
    eos_ids = end_token_ids(model.generation_config, tokenizer)
    out.mkdir(parents=True, exist_ok=True)
    engine = _engine_record(cfg)

    def update_meta() -> dict:  # from the shards on disk: another --shard process may have added some
        with _locked(out):
            meta = _meta(cfg, identity, engine, command, selection, _finished_shards(out, shards), len(shards))
            write_meta(out, meta)
        return meta

    done = set(update_meta()["shards"])  # checked: each shard on disk holds the conversations planned for it
    mine = [k for k in range(len(shards)) if cfg.shard is None or k % cfg.shard[1] == cfg.shard[0]]
    todo = [k for k in mine if shard_name(k) not in done]
    if not todo:
        return update_meta()
    if cfg.engine == "vllm":
        model = None  # vLLM loads its own copy
    regen, own_llm = _engine(cfg, model, tokenizer, eos_ids, progress, llm)
    desc = "dflow data" if cfg.shard is None else f"dflow data {cfg.shard[0]}/{cfg.shard[1]}"
    total = sum(len(shards[k]) for k in mine)
    bar = tqdm(total=total, initial=total - sum(len(shards[k]) for k in todo), unit="conv", desc=desc,
               disable=not progress)

    def finished(_: Trajectory) -> None:
        bar.update(1)
        if regen.seconds:
            bar.set_postfix(gen_tok_s=f"{regen.generated / regen.seconds:.1f}")

    try:
        last, seconds = time.perf_counter(), regen.seconds
        for k, trajs in regen.run([(k, shards[k]) for k in todo], finished,
                                  skip=lambda k: (out / shard_name(k)).exists()):
            now = time.perf_counter()
            stats = _shard_stats(trajs, regen.seconds - seconds, now - last)
            last, seconds = now, regen.seconds
            if (out / shard_name(k)).exists():  # finished meanwhile by another --shard process
                continue
            write_shard(out / shard_name(k), [(t.ids, t.mask) for t in trajs], dtype, stats, [c.id for c in shards[k]])
            update_meta()
    finally:
        bar.close()
        if own_llm is not None:
            from dflow.data.vllm_engine import shutdown

            shutdown(own_llm)
    return update_meta()
