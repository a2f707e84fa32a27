"""The multi-round rollout of one batch (docs/DESIGN.md, "Training"; paper section 4.3).

Owns the models' side of a training step: the target's context forward (once per batch, its
features and KV reused by every round), the drafter's packed rounds and their decayed losses, the
trajectory-guided transition, the packed verifier pass and the relay of its states into the next
round's block inputs, with the engine's own index map. Everything that flows from one round to
the next (proposals, transitions, verifier states) is detached; the rounds' losses are summed so
that the caller does one backward.

Cost layout: a round computes only its live blocks, in chunks of whole blocks of one sequence
(`block_chunks`), so drafter attention and the verifier pass grow linearly with the anchors per
sequence; the loss runs through `chunked_cross_entropy`. `reference=True` is the plain layout it
must equal: one dense block mask over all blocks of a sequence, logits held whole. On a GPU the
drafter and the verifier take the reference's dense masks (`dense`: fewer, larger kernels) and
the loss stays chunked. A reduced draft vocabulary (`dflow.vocab`) reaches both the same way: the
head's rows d2t, labels mapped to draft ids (those outside the map weigh nothing), proposals
mapped back to target ids.

Glossary as in the engine: anchor s (block index 0, token y_s), proposals d_1..d_{B-1}, accepted
prefix a, bonus b = y_{s'} at the next anchor s' = s+a+1, rejected suffix = indices a+1..B-1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from transformers import DynamicCache

from dflow.drafter import BlockChunks
from dflow.model import DFlowDrafter
from dflow.relay import relay_index_map
from dflow.targets import crop_cache, features_forward, stops_early, target_features
from dflow.train.batching import (Batch, additive_mask, anchor_candidates, bias_anchor_keys, block_chunks, block_labels,
                                  block_positions, loss_weights, packed_block_mask, teacher_states)
from dflow.train.loss import CHUNK_POSITIONS, draft_loss
from dflow.vocab import draft_head, to_draft, to_target

# Columns of the per-round statistics a rollout returns ([rounds + 1, len(STATS)], summed over ranks).
STATS = ("loss_sum", "weight_sum", "correct", "labels", "anchors", "accepted", "correct_1", "labels_1")
# Queries per attention chunk in the drafter, tokens per forward in the verifier pass: big enough
# for efficient matmuls, small enough that a chunk's own keys add little to its context (a CPU's
# sizes; chunk_size scales them on a GPU).
DRAFT_CHUNK_TOKENS = 128
VERIFY_CHUNK_TOKENS = 256
# On a GPU what a step costs is mostly its number of kernels, and the masks' quadratic memory is
# cheap: chunks GPU_CHUNK_SCALE times larger hold all of a sequence's blocks (at batch 32, about 26K
# operations a step instead of 178K: scripts/count_train_ops.py at batches 2 and 8, extrapolated).
GPU_CHUNK_SCALE = 32
VERIFY_FORWARD_CHUNKS = 4  # chunks per verifier forward (its batch rows)


def chunk_size(tokens: int, device: torch.device) -> int:
    """A chunk of `tokens` (queries, verifier tokens or loss positions) as sized for a CPU, on `device`."""
    return tokens * GPU_CHUNK_SCALE if device.type == "cuda" else tokens


@dataclass(frozen=True)
class TargetParts:
    """The frozen target and the pieces of it the drafter shares (embedding, LM head). A plain
    attribute of `Rollout`, not a submodule: it is neither trained nor synchronised by DDP."""

    model: nn.Module
    layer_ids: tuple[int, ...]

    @property
    def embed(self) -> nn.Module:
        return self.model.get_input_embeddings()

    @property
    def head(self) -> nn.Module:
        return self.model.get_output_embeddings()


def no_logits(ids: torch.Tensor) -> torch.Tensor:
    """HF's `logits_to_keep` as an empty index list: the LM head runs on no position (even one
    position's bf16 logits cost a copy of the whole head on the CPU)."""
    return torch.empty(0, dtype=torch.long, device=ids.device)


@torch.no_grad()
def context_forward(target: nn.Module, ids: torch.Tensor, layer_ids, keep_cache: bool):
    """The trajectory's one target forward. ids [b, T] (right-padded: real tokens never attend to
    padding) -> raw features [b, T, n_layers * hidden] and, with `keep_cache`, its KV cache. Layer
    id L - 1 (L the target's layers) is the final normed state: `--loss kl`'s teacher. Without the
    cache the forward stops after the deepest chosen layer where it can (`features_forward`)."""
    early = not keep_cache and stops_early(target, layer_ids)
    cache = DynamicCache(config=target.config) if keep_cache else None
    with torch.autocast(ids.device.type, enabled=False):
        if early:
            return features_forward(target, ids, layer_ids), None
        out = target(input_ids=ids, past_key_values=cache, use_cache=keep_cache, output_hidden_states=True,
                     logits_to_keep=no_logits(ids))
    return target_features(out.hidden_states, layer_ids), cache


@torch.no_grad()
def verify_blocks(target: nn.Module, cache: DynamicCache, layer_ids, anchors: torch.Tensor,
                  tokens: torch.Tensor) -> torch.Tensor:
    """Every block's verifier pass in ONE target forward. The block of anchor s runs tokens
    [y_s, d_1..d_{B-1}] at positions s..s+B-1 over the trajectory KV of positions < s, causally
    inside the block, as the engine's verification does with its cache cropped to s.
    anchors [b, n]; tokens [b, n, B] -> raw verifier features [b, n, B, n_layers * hidden].
    The cache is left as it came (the blocks' K/V are cropped off again)."""
    b, n, B = tokens.shape
    T = cache.get_seq_length()
    dtype = target.get_input_embeddings().weight.dtype
    mask = additive_mask(packed_block_mask(anchors, T, B, causal=True), dtype)  # [b, 1, nB, T+nB]
    with torch.autocast(tokens.device.type, enabled=False):
        out = target(input_ids=tokens.flatten(1), position_ids=block_positions(anchors, B).flatten(1),
                     attention_mask=mask, past_key_values=cache, use_cache=True, output_hidden_states=True,
                     logits_to_keep=1)
    crop_cache(cache, T)
    return target_features(out.hidden_states, layer_ids).view(b, n, B, -1)


@torch.no_grad()
def verify_chunked(target: nn.Module, cache: DynamicCache, layer_ids, rows: torch.Tensor, anchors: torch.Tensor,
                   tokens: torch.Tensor) -> torch.Tensor:
    """`verify_blocks` for a list of blocks, at a cost linear in their number: block i (sequence
    rows[i], anchor s = anchors[i], tokens [y_s, d_1..d_{B-1}]) runs at positions s..s+B-1 over the
    trajectory KV of positions < s, causally inside the block. Runs of one sequence's blocks
    (`block_chunks`) are the rows of a target forward, VERIFY_FORWARD_CHUNKS at a time, each over
    a copy of its sequence's KV cut at the forward's largest anchor (no block sees another).
    rows, anchors [m] (rows non-decreasing); tokens [m, B] -> raw verifier features [m, B, F].
    The cache is left untouched."""
    m, B = tokens.shape
    dtype = target.get_input_embeddings().weight.dtype
    chunks = sorted(block_chunks(rows, anchors, max(1, chunk_size(VERIFY_CHUNK_TOKENS, tokens.device) // B)),
                    key=lambda c: c[3])
    out = None
    for i in range(0, len(chunks), VERIFY_FORWARD_CHUNKS):
        group = chunks[i:i + VERIFY_FORWARD_CHUNKS]
        context, n = max(c[3] for c in group), max(c[2] - c[1] for c in group)
        starts = anchors.new_zeros(len(group), n)  # [g, n]; padding blocks: anchor 0, they see themselves
        ids = tokens.new_zeros(len(group), n, B)
        for k, (_, start, end, _) in enumerate(group):
            starts[k, :end - start], ids[k, :end - start] = anchors[start:end], tokens[start:end]
        seq = torch.tensor([c[0] for c in group], device=tokens.device)
        prefix = DynamicCache(ddp_cache_data=[(layer.keys[seq, :, :context], layer.values[seq, :, :context])
                                              for layer in cache.layers], config=target.config)
        mask = additive_mask(packed_block_mask(starts, context, B, causal=True), dtype)  # [g, 1, nB, context+nB]
        with torch.autocast(tokens.device.type, enabled=False):
            res = target(input_ids=ids.flatten(1), position_ids=block_positions(starts, B).flatten(1),
                         attention_mask=mask, past_key_values=prefix, use_cache=True, output_hidden_states=True,
                         logits_to_keep=no_logits(ids))
        feats = target_features(res.hidden_states, layer_ids).view(len(group), n, B, -1)  # [g, n, B, F]
        out = feats.new_empty(m, B, feats.shape[-1]) if out is None else out
        for k, (_, start, end, _) in enumerate(group):
            out[start:end] = feats[k, :end - start]
    return out


@dataclass
class Transition:
    accepted: torch.Tensor  # [b, n] a: leading proposals equal to the trajectory
    anchors: torch.Tensor  # [b, n] s' = s+a+1 (0 where the anchor stopped)
    bonus: torch.Tensor  # [b, n] b = y_{s'}
    live: torch.Tensor  # [b, n] the anchor continues: s' is a valid anchor (anchor_candidates)


def transition(proposals: torch.Tensor, batch: Batch, anchors: torch.Tensor, live: torch.Tensor) -> Transition:
    """Trajectory-guided transition (paper 4.3): match proposals [b, n, B-1] against the
    trajectory y_{s+1..s+B-1}, not against the verifier. An anchor stops when s' leaves the
    supervised span, i.e. is no longer a valid anchor position (s', s'+1 supervised)."""
    B = proposals.shape[-1] + 1
    T = batch.ids.shape[1]
    pos = block_positions(anchors, B)[..., 1:]  # [b, n, B-1]
    truth = batch.ids.gather(1, pos.clamp(max=T - 1).flatten(1)).view_as(pos)
    match = (proposals == truth) & (pos < batch.lengths[:, None, None])
    accepted = match.long().cumprod(-1).sum(-1)  # [b, n]
    nxt = anchors + accepted + 1
    inside = nxt.clamp(max=T - 1)
    keep = live & (nxt < T) & anchor_candidates(batch.loss_mask).gather(1, inside)
    return Transition(accepted, torch.where(keep, nxt, 0), batch.ids.gather(1, inside), keep)


def relay_inputs(drafter: DFlowDrafter, embed: nn.Module, features: torch.Tensor | None, accepted: torch.Tensor,
                 bonus: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """Block inputs of the round after a transition, exactly as DrafterProposer builds them:
    index 0 = E(b); with verifier features, old index j = a+i (i = 1..B-1-a) -> new index i through
    the drafter's fc + hidden_norm and the Relay module (boundary tokens b and d_{a+1}); every other
    index = E(mask). features [m, B, F] raw verifier states (None: plain masks, the `--no-relay`
    ablation); accepted, bonus, rejected [m] -> x [m, B, hidden]."""
    m = bonus.shape[0]
    B = drafter.cfg.block_size
    w = embed.weight
    dtype = next(drafter.parameters()).dtype
    mask_embed = w[drafter.cfg.mask_token_id].to(dtype)  # [hidden]
    bonus_embed = w[bonus].to(dtype)  # [m, hidden]
    x = mask_embed.expand(m, B - 1, -1)
    if features is not None and drafter.relay is not None:
        h = drafter.dflash.project(features.to(dtype))  # [m, B, hidden]
        src, use = relay_index_map(accepted, B)  # [m, B-1] old index a+i of new index i; relayed or not
        h = h.gather(1, src[..., None].expand(-1, -1, h.shape[-1]))
        relayed = drafter.relay(mask_embed, bonus_embed, w[rejected].to(dtype), h)  # [m, B-1, hidden]
        x = torch.where(use[..., None], relayed, x)
    return torch.cat([bonus_embed[:, None], x], dim=1)


class Rollout(nn.Module):
    """The training loss of one batch: round 0 (DFlash, mask inputs) and `rounds` reject-conditioned
    rounds (DFlow; `use_relay` False: the same rounds from plain masks). The module DDP wraps.
    `reference`: the plain dense layout (tests and the benchmark's baseline), same loss."""

    def __init__(self, drafter: DFlowDrafter, target: TargetParts, rounds: int, use_relay: bool,
                 reference: bool = False, compile: bool = False, loss_gamma: float | None = None,
                 dense: bool | None = None):
        super().__init__()
        # The layout of the drafter's attention and of the verifier pass over a round's blocks: True,
        # one masked call over every block slot of the batch (dead ones too; quadratic in the anchors
        # a sequence), as the reference; False, chunks of one sequence's live blocks (linear). None:
        # dense on a GPU, where a step's cost is its number of kernels (scripts/count_train_ops.py),
        # chunked on a CPU, where it is its arithmetic.
        self.dense = dense
        self.drafter = drafter
        self.target = target
        self.rounds = rounds
        self.use_relay = use_relay and drafter.relay is not None
        self.reference = reference
        self.compile = compile  # torch.compile the drafter's layers and the loss's vocabulary passes
        self.block_bias = 0.0  # attention-logit bias on a block's anchor key (the loop anneals it; 0 = DFlash)
        if compile:
            drafter.dflash.compile_layers()
        self.register_buffer("weights", loss_weights(drafter.cfg.block_size, loss_gamma), persistent=False)

    def forward(self, batch: Batch, features: torch.Tensor, cache: DynamicCache | None,
                teacher: torch.Tensor | None = None):
        """batch on the device; features [b, T, F] from `context_forward` (cache: its KV, needed
        when relaying; teacher [b, T, hidden]: the target's final states, the labels of `--loss kl`,
        else the data's tokens) -> (loss: sum over rounds of each round's weighted CE normalised by its
        weight sum over all ranks, scaled for DDP's gradient averaging; stats [rounds+1, STATS])."""
        cfg = self.drafter.cfg
        B, (b, T) = cfg.block_size, batch.ids.shape
        dtype = next(self.drafter.parameters()).dtype
        ctx = self.drafter.dflash.project(features.to(dtype))  # [b, T, hidden]
        ctx_kv = self.drafter.dflash.context_kv(ctx, torch.arange(T, device=ctx.device).expand(b, T))

        anchors, live = batch.anchors, batch.live  # [b, n]
        ids = torch.full((int(live.sum()), B), cfg.mask_token_id, device=anchors.device)
        ids[:, 0] = batch.ids.gather(1, anchors)[live]
        x = self.target.embed(ids).to(dtype)  # [m, B, hidden]: the live blocks' inputs
        d2t = self.drafter.dflash.d2t  # [N] or None: a reduced draft vocabulary (dflow.vocab)
        head = draft_head(self.target.head, d2t)  # rows d2t of the frozen head
        sums, stats = [], []
        for q in range(self.rounds + 1):
            hidden = self._draft_live(x, anchors, live, ctx_kv)  # [m, B, hidden]
            labels, valid = block_labels(batch.ids, batch.loss_mask, anchors, live, B)  # [b, n, B-1]
            # labels outside the draft vocabulary weigh nothing in the loss; in accuracy they are misses
            y, inside = to_draft(labels[live], d2t)  # [m, B-1] draft ids, in the map
            w = self.weights * (valid[live] & inside)  # [m, B-1]
            h, y = hidden[:, 1:].flatten(0, 1), y.flatten()  # [m * (B-1), hidden], [m * (B-1)]
            t = None if teacher is None else teacher_states(teacher, anchors, live, B)  # [m * (B-1), hidden]
            ce, guess = draft_loss(head, h, y, t, self.reference, self.compile, chunk_size(CHUNK_POSITIONS, h.device))
            sums.append((ce.view_as(w) * w).sum())
            proposals = torch.zeros_like(labels)
            proposals[live] = to_target(guess, d2t).view_as(w)  # [b, n, B-1] target ids
            step = transition(proposals, batch, anchors, live)
            hits = (proposals == labels) & valid  # [b, n, B-1]
            stats.append(torch.stack([t.float() for t in (sums[-1].detach(), w.sum(), hits.sum(), valid.sum(),
                                                          live.sum(), step.accepted[live].sum(),
                                                          hits[..., 0].sum(), valid[..., 0].sum())]))
            if q == self.rounds:
                break
            x = self._next_inputs(batch, anchors, proposals, step, cache)
            anchors, live = step.anchors, step.live
        stats = torch.stack(stats)  # [rounds+1, STATS]
        world = 1
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(stats)
            world = dist.get_world_size()
        weight_sum = stats[:, 1].clamp(min=1e-8)
        loss = sum(s / weight_sum[q] for q, s in enumerate(sums)) * world
        return loss, stats

    def _is_dense(self, device: torch.device) -> bool:
        return self.dense if self.dense is not None else device.type == "cuda"

    def _draft_live(self, x: torch.Tensor, anchors: torch.Tensor, live: torch.Tensor, ctx_kv) -> torch.Tensor:
        """The drafter over a round's live blocks: x [m, B, hidden] (the blocks of `live` [b, n], in
        its order) -> hidden [m, B, hidden]. One forward; attention in chunks of whole blocks, or
        (`dense`) over every block slot of the batch at once."""
        m, B, H = x.shape
        if self.reference or self._is_dense(x.device):
            packed = x.new_zeros(*live.shape, B, H)
            packed[live] = x
            return self._draft(packed, anchors, ctx_kv, ctx_kv[0][0].shape[2])[live]
        rows, starts = live.nonzero(as_tuple=True)[0], anchors[live]  # [m]
        per_chunk = max(1, chunk_size(DRAFT_CHUNK_TOKENS, x.device) // B)
        chunks = BlockChunks(tuple(
            (row, start * B, end * B,
             bias_anchor_keys(packed_block_mask(starts[None, start:end], context, B, causal=False), context, B,
                              self.block_bias))
            for row, start, end, context in block_chunks(rows, starts, per_chunk)))
        out = self.drafter.dflash(x.reshape(1, m * B, H), block_positions(starts, B).view(1, m * B), ctx_kv, chunks)
        return out.view(m, B, H)

    def _draft(self, x: torch.Tensor, anchors: torch.Tensor, ctx_kv, T: int) -> torch.Tensor:
        """Reference: one packed drafter forward over every block slot, x [b, n, B, hidden] ->
        hidden [b, n, B, hidden], through one dense mask per sequence (quadratic in n); each block
        sees context < its anchor and itself (bidirectionally)."""
        b, n, B, H = x.shape
        mask = bias_anchor_keys(packed_block_mask(anchors, T, B, causal=False), T, B, self.block_bias)  # [b, 1, nB, T+nB]
        out = self.drafter.dflash(x.reshape(b, n * B, H), block_positions(anchors, B).flatten(1), ctx_kv, mask)
        return out.view(b, n, B, H)

    def _next_inputs(self, batch: Batch, anchors: torch.Tensor, proposals: torch.Tensor, step: Transition,
                     cache: DynamicCache | None) -> torch.Tensor:
        """Block inputs [m', B, hidden] of the next round's live blocks (`step.live`): E(b) then
        relayed states or masks."""
        B = proposals.shape[-1] + 1
        features, keep = None, step.live
        if self.use_relay and keep.any():
            tokens = torch.cat([batch.ids.gather(1, anchors)[..., None], proposals], dim=-1)  # [b, n, B]
            if self.reference or self._is_dense(tokens.device):  # one target forward over all block slots
                features = verify_blocks(self.target.model, cache, self.target.layer_ids, anchors, tokens)[keep]
            else:
                features = verify_chunked(self.target.model, cache, self.target.layer_ids,
                                          keep.nonzero(as_tuple=True)[0], anchors[keep], tokens[keep])
        rejected = proposals[keep].gather(1, step.accepted[keep].clamp(max=B - 2)[:, None])[:, 0]  # d_{a+1}
        return relay_inputs(self.drafter, self.target.embed, features, step.accepted[keep], step.bonus[keep],
                            rejected)
