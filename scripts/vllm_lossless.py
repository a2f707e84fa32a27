"""Lossless check of the vLLM plugin on a real target (default: smollm2-135m), 10 HumanEval prompts:
greedy outputs of DFlow (relay on) and DFlash (relay off) through vLLM at concurrency 1 and 4 must
equal plain vLLM's at concurrency 4. Optionally (--rounds) also compares per-round acceptance with
our own engine in the same dtype. Needs the vllm extra; three engine starts.

    .venv-vllm/bin/python scripts/vllm_lossless.py [--drafter DIR] [--dtype float32] [--rounds]

Without --drafter it uses the shipped drafter, else a fresh one (`init_drafter`) whose relay
weights are randomised so that the relay is not a no-op (lossless must hold for any drafter).
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import torch


def main() -> int:
    from vllm import LLM

    from dflow.datasets import load_dataset
    from dflow.engine import generate
    from dflow.model import save_drafter
    from dflow.pipeline import Pipeline, default_drafter_dir, init_drafter
    from dflow.proposers import DrafterProposer
    from dflow.targets import resolve_target
    from dflow.vllm.launch import engine_kwargs
    from dflow.vllm.offline import shutdown, step_rounds

    p = argparse.ArgumentParser()
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--drafter", default=None)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--num-prompts", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", action="store_true", help="also compare per-round acceptance with our engine")
    p.add_argument("--memory-fraction", type=float, default=None, help="vLLM's gpu_memory_utilization (busy machine)")
    args = p.parse_args()

    pipe = Pipeline.load(args.target, None, args.dtype, need_drafter=False)
    drafter = args.drafter or default_drafter_dir(args.target)
    if drafter is None:
        d = init_drafter(pipe.target, pipe.tokenizer, seed=0)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            w = d.relay.mlp[2].weight
            w.copy_(torch.randn(w.shape, generator=g) * 0.02)
        drafter = save_drafter(d, tempfile.mkdtemp(prefix="dflow-drafter-") + "/d")
        print(f"fresh drafter with a random relay: {drafter}")
    prompts = [pipe.encode(s.turns[0]) for s in load_dataset("humaneval", args.num_prompts)]
    stops = pipe.stop_token_ids
    runs = {}
    for method in ("ar", "dflow", "dflash"):
        llm = LLM(**engine_kwargs(resolve_target(args.target), method, str(drafter), args.dtype,
                                  memory_fraction=args.memory_fraction), enforce_eager=True)
        try:
            runs[method] = {c: step_rounds(llm, prompts, args.max_new_tokens, c, ignore_eos=False, stop_token_ids=stops)
                            for c in ((4,) if method == "ar" else (1, 4))}
        finally:
            shutdown(llm)
    ref = [sum(ch, []) for ch in runs["ar"][4]]
    ok = True
    for method in ("dflow", "dflash"):
        for c in (1, 4):
            got = [sum(ch, []) for ch in runs[method][c]]
            bad = [i for i, (a, b) in enumerate(zip(got, ref)) if a != b]
            ok &= not bad
            print(f"{method} c={c}: {len(ref) - len(bad)}/{len(ref)} outputs equal plain vLLM's", bad or "")
    if args.rounds:
        full = Pipeline.load(args.target, str(drafter), args.dtype)
        for method in ("dflow", "dflash"):
            same = total = 0
            tokens = {"ours": [0, 0], "vllm": [0, 0]}  # committed tokens, decode rounds (first token excluded)
            for i, ids in enumerate(prompts):
                r = generate(full.target, ids, proposer=DrafterProposer(full.drafter, full.target, method == "dflow"),
                             block_size=full.drafter.cfg.block_size, max_new_tokens=args.max_new_tokens,
                             stop_token_ids=stops)
                ours = [1] + [x.committed for x in r.rounds]
                theirs = [len(ch) for ch in runs[method][4][i]]
                n = min(len(ours), len(theirs)) - 1  # the last round may be cut by max_new_tokens
                same += sum(a == b for a, b in zip(ours[:n], theirs[:n]))
                total += n
                for key, seq in (("ours", ours), ("vllm", theirs)):
                    tokens[key][0] += sum(seq[1:])
                    tokens[key][1] += len(seq) - 1
            tau = {k: c / max(r, 1) for k, (c, r) in tokens.items()}
            print(f"{method}: {same}/{total} rounds with the same committed count as our engine; "
                  f"tau {tau['vllm']:.4f} in vLLM vs {tau['ours']:.4f} in our engine "
                  f"({100 * (tau['vllm'] / tau['ours'] - 1):+.2f}%)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
