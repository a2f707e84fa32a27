"""The index-1 yardstick of issue 18: what a block's first draft position could already know.

Index 1 of the block at anchor s predicts y_{s+1} from the anchor token y_s and the target's
features of positions <= s-1. Over the pairs where s and s+1 are both assistant tokens (the
trainer's anchor positions) of a data folder whose last --held-out conversations are held out
(as `dflow train --eval-samples N` holds them out), it prints held-out top-1 accuracy of

    bigram    y_s -> its most frequent successor among the training pairs (also: among all
              consecutive tokens of the training sequences)
    last      a two-layer MLP over [rms(target's last-layer state at s-1); E(y_s)] into the frozen tied head
    fused     the same MLP over the drafter's fused layers at s-1, each RMS-normed, instead
    drafter   the drafter teacher-forced as the training rollout's round 0 runs it, on every anchor of
              the held-out sequences: accuracy at block indices 1..4

The target's states come from a feature cache when one is given (`dflow features --drafter D
--last-state --dtype bfloat16`), else from one target forward per conversation.

    OMP_NUM_THREADS=1 taskset -c 0 python scripts/probe_index1.py --pairs 200000 --time-limit 300
    python scripts/probe_index1.py --probes drafter --drafter runs/x   # a drafter at any stage
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from dflow.vocab import apply_head
from dflow.model import check_fits_target, load_drafter
from dflow.pipeline import default_drafter_dir
from dflow.targets import DEFAULT_TARGET, load_target
from dflow.train.batching import anchor_candidates, block_labels
from dflow.train.dataset import load_train_data
from dflow.train.features import open_features
from dflow.train.rollout import context_forward
from dflow.train.teacher import round0_hidden

PROBES = ("bigram", "last", "fused", "drafter")


def rms(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Parameter-free RMS norm over the last dim (in float32)."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class States:
    """Per-conversation target states [t, F]: the drafter's fused layers and the last layer (the
    final normed state), from a feature cache or from a live target forward."""

    def __init__(self, target, layer_ids, cache=None):
        self.target, self.layer_ids, self.cache = target, tuple(layer_ids), cache

    def __call__(self, ids: torch.Tensor, source: int) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [t] of the folder's sequence `source` -> (fused [t, n*hidden], last [t, hidden])."""
        t = len(ids)
        if self.cache is not None:
            return self.cache.features(source)[:t], self.cache.last(source)[:t]
        L, H = self.target.config.num_hidden_layers, self.target.config.hidden_size
        feats, _ = context_forward(self.target, ids[None], self.layer_ids + (L - 1,), keep_cache=False)
        return feats[0, :, :-H], feats[0, :, -H:]


def collect_pairs(examples, sources, states: States | None) -> dict[str, torch.Tensor]:
    """Every pair (s, s+1) both assistant tokens: token y_s, label y_{s+1}, and (with `states`) the
    states at s-1 in bfloat16."""
    out = {"token": [], "label": [], "fused": [], "last": []}
    for (ids, mask), source in zip(examples, sources):
        s = anchor_candidates(mask).nonzero().flatten()  # [p], all >= 1
        out["token"].append(ids[s])
        out["label"].append(ids[s + 1])
        if states is not None:
            fused, last = states(ids, source)
            out["fused"].append(fused[s - 1].bfloat16())
            out["last"].append(last[s - 1].bfloat16())
    return {k: torch.cat(v) for k, v in out.items() if v}


def bigram_table(prev: torch.Tensor, nxt: torch.Tensor, vocab: int) -> torch.Tensor:
    """[vocab]: each token's most frequent successor in (prev, nxt) pairs (ties: the smaller id);
    tokens never seen as prev get the most frequent successor overall."""
    keys, counts = (prev * vocab + nxt).unique(return_counts=True)
    p, n = keys // vocab, keys % vocab
    order = torch.argsort(counts, descending=True, stable=True)
    order = order[torch.argsort(p[order], stable=True)]  # grouped by prev, most frequent first
    first = torch.ones(len(order), dtype=torch.bool)
    first[1:] = p[order][1:] != p[order][:-1]
    table = torch.full((vocab,), int(torch.bincount(nxt, minlength=vocab).argmax()), dtype=torch.long)
    table[p[order][first]] = n[order][first]
    return table


class Probe(nn.Module):
    """Two-layer MLP over [rms(state parts); E(y_s)] -> RMSNorm -> the target's frozen tied head."""

    def __init__(self, parts: int, embed: torch.Tensor, width: int):
        super().__init__()
        hidden = embed.shape[1]
        self.parts = parts
        self.fc1 = nn.Linear((parts + 1) * hidden, width)
        self.fc2 = nn.Linear(width, hidden)
        self.norm = nn.RMSNorm(hidden)
        self.register_buffer("embed", embed, persistent=False)  # [vocab, hidden] frozen (embedding = head)

    def forward(self, states: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """states [m, parts * hidden]; token [m] -> logits [m, vocab]."""
        x = torch.cat([rms(p) for p in states.chunk(self.parts, -1)] + [self.embed[token].float()], -1)
        h = self.norm(self.fc2(F.silu(self.fc1(x))).float())
        return F.linear(h.to(self.embed.dtype), self.embed).float()


@torch.no_grad()
def accuracy(probe: Probe, states: torch.Tensor, token: torch.Tensor, label: torch.Tensor, batch: int = 1024) -> float:
    hits = sum(int((probe(states[i:i + batch], token[i:i + batch]).argmax(-1) == label[i:i + batch]).sum())
               for i in range(0, len(label), batch))
    return hits / len(label)


def train_probe(key: str, train: dict, held: dict, embed: torch.Tensor, parts: int, pairs: int, args) -> dict:
    """The MLP over states `key` ("last" or "fused", in `parts` layers), trained on `pairs` pairs
    (epochs over the training pool): AdamW, warmup + cosine, bf16 autocast; held-out accuracy every
    `args.eval_every` pairs and at the end (or at --time-limit)."""
    torch.manual_seed(args.seed)
    probe = Probe(parts, embed, args.width)
    opt = torch.optim.AdamW(probe.parameters(), lr=args.lr, weight_decay=0.0)
    steps = math.ceil(pairs / args.batch_size)
    warmup = max(1, steps // 50)
    curve, seen, t0, pool = [], 0, time.perf_counter(), len(train["label"])
    perm = torch.randperm(pool)
    for step in range(steps):
        lr = args.lr * min((step + 1) / warmup, 0.5 * (1 + math.cos(math.pi * step / steps)))
        for group in opt.param_groups:
            group["lr"] = lr
        idx = perm[torch.arange(seen, seen + args.batch_size) % pool]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(probe(train[key][idx], train["token"][idx]), train["label"][idx])
        loss.backward()
        loss = loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        seen += args.batch_size
        over = args.time_limit is not None and time.perf_counter() - t0 > args.time_limit
        if seen // args.eval_every != (seen - args.batch_size) // args.eval_every or step == steps - 1 or over:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                acc = accuracy(probe, held[key], held["token"], held["label"])
            curve.append({"pairs": seen, "epochs": seen / pool, "held_out_acc": acc, "loss": float(loss),
                          "seconds": time.perf_counter() - t0})
            print(f"  {key}: {seen} pairs ({seen / pool:.2f} epochs), held-out accuracy {acc:.4f}, "
                  f"loss {float(loss):.3f}, {curve[-1]['seconds']:.0f} s", file=sys.stderr, flush=True)
        if over:
            break
    return {"held_out_acc": curve[-1]["held_out_acc"], "pairs": seen, "curve": curve}


@torch.no_grad()
def drafter_hits(drafter, target, examples, sources, states: States, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced hits on every anchor of `examples`, with the logits of the training rollout's
    round 0 (dflow/train/teacher.py) and the target's full head -> (correct [B-1], labels [B-1]) per
    block index 1..B-1."""
    B = drafter.cfg.block_size
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    correct, count = torch.zeros(B - 1), torch.zeros(B - 1)
    for (ids, mask), source in zip(examples, sources):
        fused, _ = states(ids, source)
        anchors = anchor_candidates(mask).nonzero().flatten()
        for rows, hidden in round0_hidden(drafter.dflash, embed, ids, fused, anchors, chunk):
            logits = apply_head(head, hidden.to(head.weight.dtype))  # [m, B-1, V]
            a = anchors[rows][None]
            labels, valid = block_labels(ids[None], mask[None], a, torch.ones_like(a, dtype=torch.bool), B)
            correct += ((logits.argmax(-1) == labels[0]) & valid[0]).sum(0)
            count += valid[0].sum(0)
    return correct, count


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="data/smollm2-135m-sharegpt-3000")
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--drafter", default=None, help="its fused layers for `fused`, itself for `drafter` "
                                                    "(default: the drafter shipped for the target)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16", help="the target's weights")
    p.add_argument("--feature-cache", default=None, help="a `dflow features --drafter D --last-state` folder")
    p.add_argument("--probes", default=",".join(PROBES), help=f"comma-separated, of {', '.join(PROBES)}")
    p.add_argument("--held-out", type=int, default=24, help="the folder's last N usable conversations")
    p.add_argument("--conversations", type=int, default=None, help="training conversations to take pairs from")
    p.add_argument("--pairs", type=int, default=200_000, help="training pairs each MLP sees (epochs over the pool)")
    p.add_argument("--fused-pairs", type=int, default=None, help="the same for the fused-layer MLP (default --pairs)")
    p.add_argument("--time-limit", type=float, default=None, help="seconds per MLP; stops it early")
    p.add_argument("--eval-every", type=int, default=50_000, help="pairs between held-out evaluations")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--width", type=int, default=2048, help="the MLP's hidden width")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    probes = args.probes.split(",")
    if not set(probes) <= set(PROBES):
        p.error(f"--probes: unknown {sorted(set(probes) - set(PROBES))}")

    drafter_dir = args.drafter or default_drafter_dir(args.target)
    if drafter_dir is None:
        p.error(f"no drafter ships for {args.target}: give --drafter")
    t0 = time.perf_counter()
    target, tokenizer = load_target(args.target, args.dtype)
    drafter = load_drafter(drafter_dir)
    check_fits_target(drafter.cfg, target.config)
    layer_ids = drafter.cfg.target_layer_ids
    data = load_train_data(args.data, target, tokenizer, target.config.max_position_embeddings, args.held_out)
    cache = None if args.feature_cache is None else open_features(args.feature_cache, args.data, target, layer_ids)
    states = States(target, layer_ids, cache)
    held_src = data.held_out_source
    train_ex = data.train[:args.conversations]
    train_src = data.train_source[:args.conversations]
    need = {"last", "fused"} & set(probes)
    train = collect_pairs(train_ex, train_src, states if need else None)
    held = collect_pairs(data.held_out, held_src, states if need else None)
    res = {"data": args.data, "train_conversations": len(train_ex), "held_out_conversations": len(data.held_out),
           "train_pairs": len(train["label"]), "held_out_pairs": len(held["label"]), "layer_ids": list(layer_ids),
           "states_s": time.perf_counter() - t0}
    print(f"{len(train_ex)} training conversations ({res['train_pairs']} pairs), {len(data.held_out)} held out "
          f"({res['held_out_pairs']} pairs); states in {res['states_s']:.0f} s", file=sys.stderr, flush=True)
    V = target.config.vocab_size
    if "bigram" in probes:
        res["bigram"] = float((bigram_table(train["token"], train["label"], V)[held["token"]] == held["label"]).float().mean())
        prev = torch.cat([ids[:-1] for ids, _ in train_ex])
        nxt = torch.cat([ids[1:] for ids, _ in train_ex])
        res["bigram_all_tokens"] = float((bigram_table(prev, nxt, V)[held["token"]] == held["label"]).float().mean())
    embed = target.get_input_embeddings().weight.detach().bfloat16()
    for name, parts, pairs in (("last", 1, args.pairs), ("fused", len(layer_ids), args.fused_pairs or args.pairs)):
        if name in probes:
            res[name] = train_probe(name, train, held, embed, parts, pairs, args)
    if "drafter" in probes:
        correct, count = drafter_hits(drafter, target, data.held_out, held_src, states)
        res["drafter_index_acc"] = (correct / count.clamp(min=1))[:4].tolist()
    res["seconds"] = time.perf_counter() - t0
    print(f"\nindex-1 held-out accuracy on {args.data} ({res['held_out_pairs']} pairs of {len(data.held_out)} "
          f"conversations; MLPs trained on pairs of {len(train_ex)} conversations)")
    if "bigram" in res:
        print(f"  bigram (training pairs)          {res['bigram']:.4f}\n"
              f"  bigram (all training tokens)     {res['bigram_all_tokens']:.4f}")
    for name, what in (("last", "MLP, last layer"), ("fused", f"MLP, fused layers {list(layer_ids)}")):
        if name in res:
            print(f"  {what:<32} {res[name]['held_out_acc']:.4f} after {res[name]['pairs']} pairs")
    if "drafter_index_acc" in res:
        print("  drafter, indices 1-4             " + " ".join(f"{a:.4f}" for a in res["drafter_index_acc"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
