"""tau at T > 0: rejection sampling vs the DFlash reference's sample-and-match (issue 5's bar).

    python scripts/bench_sampling.py [--drafter DIR] [--num-prompts 10] [--max-new-tokens 64]

Runs the first HumanEval prompts through the default target (bf16) with one drafter, once per
acceptance rule, with the same seed per prompt, and prints tau (docs/DESIGN.md) for both.
Bar: rejection sampling is not lower than match. With an untrained drafter both are ~1.
"""

from __future__ import annotations

import argparse
import time

import torch

from dflow import metrics
from dflow.datasets import load_dataset
from dflow.engine import SamplingParams
from dflow.pipeline import METHODS, Pipeline

RULES = ("rejection", "match")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--drafter", default=None, help="default: the pipeline's (a fresh one if none ships)")
    ap.add_argument("--method", choices=METHODS[1:], default="dflow")
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0, help="prompt i uses seed + i under both rules")
    ap.add_argument("--threads", type=int, default=1, help="1 is fastest on a busy machine")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    pipe = Pipeline.load(args.target, args.drafter, "bfloat16")
    print(f"drafter: {pipe.drafter_note}")
    prompts = [pipe.encode(s.turns[0]) for s in load_dataset("humaneval", args.num_prompts)]
    rounds = {rule: [] for rule in RULES}  # per rule: one list of RoundStats per prompt
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        for rule in RULES:  # interleaved, so machine load hits both rules alike
            params = SamplingParams(args.temperature, args.top_k, args.top_p, rule, args.seed + i)
            rounds[rule].append(pipe.generate(ids, args.method, args.max_new_tokens, params=params).rounds)
        print(f"prompt {i + 1}/{len(prompts)}: tau " + "  ".join(
            f"{rule} {metrics.tau(rounds[rule][-1:]):.3f}" for rule in RULES), flush=True)

    tau = {rule: metrics.tau(rounds[rule]) for rule in RULES}
    print(f"\n{args.method}, T = {args.temperature}, top-k {args.top_k}, top-p {args.top_p}, "
          f"{len(prompts)} HumanEval prompts, {args.max_new_tokens} new tokens, "
          f"{time.perf_counter() - t0:.0f} s")
    for rule in RULES:
        print(f"  {rule:9s} tau {tau[rule]:.3f}  mean accepted {metrics.mean_accepted(rounds[rule]):.3f}")
    ok = tau["rejection"] >= tau["match"]
    print(f"bar (rejection >= match): {'PASS' if ok else 'FAIL'}")


if __name__ == "__main__":
    main()
