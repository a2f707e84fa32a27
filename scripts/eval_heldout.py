"""Held-out tau of a saved drafter, exactly as `dflow train` measures it during a run (the engine,
greedy, on the data folder's last --held-out conversations), for a snapshot taken between the
run's own evaluations (e.g. issue 18's 2-core-hour mark); with --teacher N, also whether the engine
drafts what training teaches:

    OMP_NUM_THREADS=1 taskset -c 1 python scripts/eval_heldout.py DRAFTER --data DIR [--held-out 24] \
        [--tokens 64] [--max-len 1536] [--dtype bfloat16] [--method dflash|dflow] [--block-size B] [--teacher 8] \
        [--json FILE]

--block-size B drafts blocks of B instead of the drafter's own: what a
smaller block keeps of tau, for choosing B by decode speed (scripts/bench_depth.py times the rounds).

--teacher N decodes the first N held-out prompts again (dflash, the drafter in the target's dtype, as
the trainer's tau), recording each round's anchor s, its proposals and its accepted length a. Then,
on the output sequence (prompt + new tokens), it runs the drafter as the training rollout's round 0
runs it (one target forward over the whole sequence, context < s, mask inputs, packed blocks) at
those anchors, with the engine's draft head, and counts the teacher-forced accepted length against
the output. With no train/inference mismatch the two agree round by round, up to bf16 rounding (the
engine's features come from block-by-block verification, the teacher's from one forward; the last
blocks, which the token cap shortens, attend over fewer mask positions than training's full blocks).
It reports both means, the share of rounds where a is equal and the share of proposals that are
the same token; then the teacher-forced accepted length over every anchor of the held-out
conversations' stored replies (the training metric's distribution), so a gap between the trainer's
teacher-forced figure and the engine's tau splits into mismatch and distribution.
"""

from __future__ import annotations

import argparse
import json

import torch

from dflow.drafter import check_block_size
from dflow.engine import generate
from dflow.model import load_drafter
from dflow.pipeline import Pipeline
from dflow.proposers import DrafterProposer
from dflow.targets import DEFAULT_TARGET, load_target
from dflow.train.batching import anchor_candidates
from dflow.train.dataset import load_train_data, prompt_of
from dflow.train.logs import held_out_tau
from dflow.train.rollout import context_forward
from dflow.train.teacher import round0_hidden
from dflow.vocab import apply_head, to_target_logits


class Recording(DrafterProposer):
    """The engine's proposer, keeping each round's anchor position and greedy proposals."""

    def start_recording(self) -> None:
        self.anchors: list[int] = []
        self.proposals: list[list[int]] = []

    def propose(self, anchor, position, size):
        logits = super().propose(anchor, position, size)
        self.anchors.append(position)
        self.proposals.append(logits[0].argmax(-1).tolist())
        return logits


@torch.no_grad()
def teacher_proposals(proposer: DrafterProposer, target, ids: torch.Tensor, anchors: torch.Tensor,
                      chunk: int = 64) -> torch.Tensor:
    """ids [T], anchors [n] -> the drafter's greedy proposals [n, B-1] under the rollout's round 0."""
    features, _ = context_forward(target, ids[None], proposer.layer_ids, keep_cache=False)  # [1, T, F]
    out = torch.empty(len(anchors), proposer.model.cfg.block_size - 1, dtype=torch.long)
    for rows, hidden in round0_hidden(proposer.model, proposer.embed, ids, features[0], anchors, chunk):
        out[rows] = to_target_logits(apply_head(proposer.head, hidden), proposer.d2t, proposer.vocab_size).argmax(-1)
    return out


def accepted_length(proposals: torch.Tensor, ids: torch.Tensor, anchors: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """proposals [n, B-1] for anchors [n] against ids [T] -> leading matches [n], at most limit [n]
    (a block never runs past the sequence's end)."""
    B1 = proposals.shape[1]
    pos = (anchors[:, None] + 1 + torch.arange(B1)).clamp(max=len(ids) - 1)  # [n, B-1]
    inside = torch.arange(B1)[None] < limit[:, None]
    match = (proposals == ids[pos]) & inside
    return match.long().cumprod(-1).sum(-1)


def versus_teacher(drafter, target, tokenizer, held_out, prompts: int, tokens: int) -> dict:
    """The engine's rounds on the first `prompts` held-out prompts against the teacher-forced ones
    at the same anchors, and the teacher-forced accepted length over all held-out anchors."""
    drafter = drafter.to(dtype=target.get_input_embeddings().weight.dtype).eval()
    proposer = Recording(drafter, target, use_relay=False)
    stops = Pipeline(target, tokenizer, drafter).stop_token_ids
    B = drafter.cfg.block_size
    engine_a, teacher_a, same_rounds, same_tokens, count = [], [], 0, 0, 0
    for ex in held_out[:prompts]:
        prompt = prompt_of(ex)
        proposer.start_recording()
        out = generate(target, prompt, proposer=proposer, block_size=B, max_new_tokens=tokens, stop_token_ids=stops)
        ids, anchors = torch.tensor(prompt + out.token_ids), torch.tensor(proposer.anchors)
        limit = torch.tensor([min(len(d), len(ids) - 1 - s) for d, s in zip(proposer.proposals, proposer.anchors)])
        tf = teacher_proposals(proposer, target, ids, anchors)
        eng = torch.full_like(tf, -1)
        for r, d in enumerate(proposer.proposals):
            eng[r, :len(d)] = torch.tensor(d)
        a_tf = accepted_length(tf, ids, anchors, limit)
        a_eng = torch.tensor([r.accepted for r in out.rounds if r.drafted])
        engine_a += a_eng.tolist()
        teacher_a += a_tf.tolist()
        same_rounds += int((a_tf == a_eng).sum())
        valid = torch.arange(tf.shape[1])[None] < limit[:, None]
        same_tokens += int(((tf == eng) & valid).sum())
        count += int(valid.sum())
    all_a = []  # the training metric's distribution: every anchor of the stored held-out replies
    for ids, mask in held_out:
        anchors = anchor_candidates(mask).nonzero().flatten()
        limit = torch.full_like(anchors, B - 1).minimum(len(ids) - 1 - anchors)
        all_a += accepted_length(teacher_proposals(proposer, target, ids, anchors), ids, anchors, limit).tolist()
    rounds = len(engine_a)
    return {"teacher_prompts": prompts, "rounds": rounds, "engine_accepted": sum(engine_a) / rounds,
            "teacher_accepted_same_anchors": sum(teacher_a) / rounds, "same_accepted_share": same_rounds / rounds,
            "same_proposal_share": same_tokens / max(1, count),
            "teacher_accepted_all_held_out_anchors": sum(all_a) / len(all_a), "held_out_anchors": len(all_a)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("drafter")
    p.add_argument("--data", required=True)
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--held-out", type=int, default=24)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--max-len", type=int, default=1536)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--method", choices=("dflash", "dflow"), default="dflash")
    p.add_argument("--block-size", type=int, default=None, help="draft blocks of B (default: the drafter's)")
    p.add_argument("--teacher", type=int, default=0, metavar="N",
                   help="also compare the engine's rounds with teacher-forced ones on the first N held-out prompts")
    p.add_argument("--json", default=None, help="also write the record here")
    args = p.parse_args()
    target, tokenizer = load_target(args.target, args.dtype, "cpu")
    data = load_train_data(args.data, target, tokenizer, args.max_len, args.held_out)
    drafter = load_drafter(args.drafter, torch.float32)
    if args.block_size is not None:
        check_block_size(args.block_size, "--block-size")
    rec = held_out_tau(drafter, target, tokenizer, data.held_out, args.method == "dflow", args.tokens, args.block_size)
    if args.teacher:
        rec.update(versus_teacher(drafter, target, tokenizer, data.held_out, args.teacher, args.tokens))
    rec = {"drafter": args.drafter, "held_out": len(data.held_out), "tokens": args.tokens,
           "block_size": args.block_size or drafter.cfg.block_size, **rec}
    print(json.dumps(rec))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rec, f, indent=1)


if __name__ == "__main__":
    main()
