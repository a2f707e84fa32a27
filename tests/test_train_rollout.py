"""The rollout on tiny random targets: packed drafter rounds and the packed verifier pass equal
their one-block-at-a-time (engine) counterparts; the relay mapping is the engine's; gradients;
the linear (chunked) layouts equal the dense reference."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from conftest import TINY_VOCAB, tiny_target
from dflow.train.batching import bias_anchor_keys
from dflow.train.loop import block_bias
from dflow.vocab import apply_head
from dflow.engine import generate
from dflow.targets import crop_cache, target_features
from dflow.model import DFlowDrafter, config_for_target
from dflow.proposers import DrafterProposer
from dflow.train.batching import Batch, collate, packed_block_mask, sample_anchors
from dflow.train import rollout as rollout_module
from dflow.train.loss import chunked_cross_entropy, draft_loss, full_cross_entropy
from dflow.train.rollout import (STATS, Rollout, TargetParts, context_forward, relay_inputs, verify_blocks,
                                 verify_chunked)

B = 8
MASK_ID = 3


def drafter_for(target, relay_scale=0.3, seed=1) -> DFlowDrafter:
    """A random drafter whose relay is not a no-op (so the relay path really shows)."""
    d = DFlowDrafter(config_for_target(target.config, 2, B, mask_token_id=MASK_ID)).init_weights(seed, std=0.1)
    with torch.no_grad():
        w = d.relay.mlp[2].weight
        w.copy_(torch.randn(w.shape, generator=torch.Generator().manual_seed(seed)) * relay_scale)
    return d


def random_batch(lengths=(40, 27, 33), anchors=4, seed=0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for n in lengths:
        mask = torch.zeros(n, dtype=torch.bool)
        mask[6:] = True
        seqs.append((torch.randint(4, TINY_VOCAB, (n,), generator=g), mask))
    return collate(seqs, [sample_anchors(m, anchors, g) for _, m in seqs])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("layer_ids", [(0, 2), (1,), (0, 2, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_context_forward_without_cache_stops_after_its_deepest_layer(arch, layer_ids, dtype):
    """The features-only context forward gives the full forward's features bit for bit, and the
    layers above the deepest chosen one do not run (all of them do when id L - 1 is chosen)."""
    target = tiny_target(arch, layers=6).to(dtype)
    batch = random_batch()
    with torch.no_grad():
        out = target(input_ids=batch.ids, output_hidden_states=True)
    ran = []
    handles = [layer.register_forward_hook(lambda m, a, o, i=i: ran.append(i))
               for i, layer in enumerate(target.model.layers)]
    feats, cache = context_forward(target, batch.ids, layer_ids, keep_cache=False)
    for h in handles:
        h.remove()
    assert cache is None
    assert torch.equal(feats, target_features(out.hidden_states, layer_ids))
    assert ran == list(range(max(layer_ids) + 1))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_packed_verifier_equals_engine_verification(arch):
    """All blocks in one target forward == the engine's verification of each block (its cache
    cropped to s, the block forwarded at positions s..s+B-1), float32, atol 1e-4."""
    target = tiny_target(arch)
    layer_ids = (0, 1, 2)
    batch = random_batch()
    _, cache = context_forward(target, batch.ids, layer_ids, keep_cache=True)
    T = cache.get_seq_length()
    tokens = torch.randint(4, TINY_VOCAB, (*batch.anchors.shape, B), generator=torch.Generator().manual_seed(1))
    tokens[..., 0] = batch.ids.gather(1, batch.anchors)
    packed = verify_blocks(target, cache, layer_ids, batch.anchors, tokens)  # [b, n, B, F]
    assert cache.get_seq_length() == T  # the trajectory cache is left as it came
    checked = 0
    for i in range(len(batch.ids)):
        n = int(batch.lengths[i])
        engine_cache = DynamicCache(config=target.config)
        target(input_ids=batch.ids[i:i + 1, :n], past_key_values=engine_cache, use_cache=True)
        for j in reversed(batch.live[i].nonzero().flatten().tolist()):  # cropping only ever rolls back
            s = int(batch.anchors[i, j])
            crop_cache(engine_cache, s)
            out = target(input_ids=tokens[i:i + 1, j], position_ids=torch.arange(s, s + B)[None],
                         past_key_values=engine_cache, use_cache=True, output_hidden_states=True)
            ref = target_features(out.hidden_states, layer_ids)[0]  # [B, F]
            torch.testing.assert_close(packed[i, j], ref, atol=1e-4, rtol=0)
            checked += 1
    assert checked == int(batch.live.sum()) >= 10


def test_packed_drafter_blocks_equal_separate_blocks():
    """A packed block sees context < its anchor and itself only: its outputs equal a forward of
    that block alone over the context features of positions < s."""
    target = tiny_target("llama")
    d = drafter_for(target)
    batch = random_batch(lengths=(40, 30))
    feats, _ = context_forward(target, batch.ids, d.cfg.target_layer_ids, keep_cache=False)
    rollout = Rollout(d, TargetParts(target, d.cfg.target_layer_ids), 0, True)
    ctx = d.dflash.project(feats)
    b, T = batch.ids.shape
    ctx_kv = d.dflash.context_kv(ctx, torch.arange(T).expand(b, T))
    x = torch.randn(*batch.anchors.shape, B, d.cfg.hidden_size)
    packed = rollout._draft(x, batch.anchors, ctx_kv, T)
    for i in range(b):
        for j in range(batch.anchors.shape[1]):
            s = int(batch.anchors[i, j])
            alone = d.dflash(x[i:i + 1, j], torch.arange(s, s + B)[None],
                             d.dflash.context_kv(ctx[i:i + 1, :s], torch.arange(s)[None]))
            torch.testing.assert_close(packed[i, j], alone[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("accepted", [0, 2, B - 2, B - 1])
def test_relay_inputs_equal_the_engines(accepted):
    """Same verifier states, a, b and d_{a+1} -> the same block inputs DrafterProposer builds."""
    target = tiny_target("llama")
    d = drafter_for(target).eval()
    g = torch.Generator().manual_seed(accepted)
    F_ = len(d.cfg.target_layer_ids) * d.cfg.hidden_size
    feats = torch.randn(1, B, F_, generator=g)  # verifier states of old indices 0..B-1
    draft = torch.randint(4, TINY_VOCAB, (1, B - 1), generator=g)
    bonus = torch.tensor([7])
    proposer = DrafterProposer(d, target, use_relay=True)
    proposer.prefill(proposer.fuse(torch.randn(1, 5, F_, generator=g)), 5 + B)
    proposer.relay_rejected(proposer.fuse(feats), torch.cat([torch.tensor([[9]]), draft], dim=1), torch.tensor([accepted]), bonus)
    seen = []
    hook = d.dflash.register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
    proposer.propose(bonus, 5, B)
    hook.remove()
    with torch.no_grad():
        ours = relay_inputs(d, target.get_input_embeddings(), feats, torch.tensor([accepted]), bonus,
                            draft[:, min(accepted, B - 2)])
    torch.testing.assert_close(ours, seen[0], atol=1e-5, rtol=0)
    n_relayed = B - 1 - accepted
    mask_embed = target.get_input_embeddings().weight[MASK_ID]
    assert not torch.allclose(ours[0, 1:1 + n_relayed], mask_embed.expand(n_relayed, -1)) or n_relayed == 0
    assert torch.equal(ours[0, 1 + n_relayed:], mask_embed.expand(B - 1 - n_relayed, -1))


def run_rollout(target, d, rounds, relay, batch=None):
    batch = batch or random_batch()
    feats, cache = context_forward(target, batch.ids, d.cfg.target_layer_ids, keep_cache=relay and rounds > 0)
    rollout = Rollout(d, TargetParts(target, d.cfg.target_layer_ids), rounds, relay)
    loss, stats = rollout(batch, feats, cache)
    return loss, stats


@pytest.mark.parametrize("rounds, relay, relay_grads", [(2, True, True), (2, False, False), (0, True, False)])
def test_one_backward_and_where_gradients_go(rounds, relay, relay_grads):
    target = tiny_target("llama")
    d = drafter_for(target)
    calls = []
    hook = target.register_forward_pre_hook(lambda *a: calls.append(1))  # a call (the context forward may stop early)
    loss, stats = run_rollout(target, d, rounds, relay)
    hook.remove()
    # the context forward once, then one packed verifier pass per relayed transition
    assert len(calls) == 1 + (rounds if relay else 0)
    assert stats.shape == (rounds + 1, len(STATS)) and (stats[:, STATS.index("anchors")] > 0).all()
    per_round = stats[:, 0] / stats[:, 1]
    torch.testing.assert_close(loss.detach(), per_round.sum())  # L = L(0) + ... + L(k)
    loss.backward()
    assert all(p.grad is not None for p in d.dflash.parameters())
    assert all(p.grad is None for p in target.parameters())
    got = [p.grad is not None and bool(p.grad.abs().sum() > 0) for p in d.relay.parameters()]
    assert any(got) if relay_grads else not any(got)


def test_later_rounds_change_the_gradient():
    """Rounds 1..k add their own loss terms to the same graph (not a re-run of round 0)."""
    target = tiny_target("llama")
    grads = []
    for rounds in (0, 2):
        d = drafter_for(target)
        loss, stats = run_rollout(target, d, rounds, True)
        loss.backward()
        grads.append(d.dflash.fc.weight.grad.clone())
    assert not torch.allclose(grads[0], grads[1])


def test_dead_anchors_have_no_labels_and_masks_have_no_empty_rows():
    target = tiny_target("qwen3")
    d = drafter_for(target)
    batch = random_batch(lengths=(12, 40), anchors=6)  # short sequence: few anchors, padding
    loss, stats = run_rollout(target, d, 2, True, batch)
    assert torch.isfinite(loss) and torch.isfinite(stats).all()
    m = packed_block_mask(batch.anchors, batch.ids.shape[1], B, causal=True)
    assert m.any(-1).all()


@pytest.mark.parametrize("rounds, relay, method", [(0, False, "dflash"), (2, True, "dflow")])
def test_training_teaches_what_the_engine_uses(rounds, relay, method):
    """End to end: fit the drafter to one target-generated sequence with the training loss, then
    decode that prompt with the engine. Tau must rise well above the untrained drafter's; a label,
    position or feature misalignment between training and inference would keep it near 1."""
    target = tiny_target("llama", layers=2)
    prompt = torch.tensor([5, 9, 17, 33, 12, 40, 7, 21])
    ar = generate(target, prompt.tolist(), max_new_tokens=48)
    ids = torch.tensor(prompt.tolist() + ar.token_ids)
    mask = torch.zeros(len(ids), dtype=torch.bool)
    mask[len(prompt):] = True
    drafter = DFlowDrafter(config_for_target(target.config, 1, B, mask_token_id=MASK_ID)).init_weights(0)

    def engine_tau():
        proposer = DrafterProposer(drafter.eval(), target, use_relay=relay)
        out = generate(target, prompt.tolist(), proposer=proposer, block_size=B, max_new_tokens=48)
        assert out.token_ids == ar.token_ids  # still lossless
        return out.tau

    before = engine_tau()
    rollout = Rollout(drafter.train(), TargetParts(target, drafter.cfg.target_layer_ids), rounds, use_relay=relay)
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(120):
        batch = collate([(ids, mask)], [sample_anchors(mask, 24, g)])
        features, cache = context_forward(target, batch.ids, drafter.cfg.target_layer_ids, keep_cache=rounds > 0)
        loss, _ = rollout(batch, features, cache)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    after = engine_tau()
    assert before < 1.5 and after > 3.0, (before, after)


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of two blocks (drafter) and of one or two blocks, two per forward (verifier): every
    chunk boundary, padding block and forward group of the linear layouts shows on a tiny batch."""
    monkeypatch.setattr(rollout_module, "DRAFT_CHUNK_TOKENS", 2 * B)
    monkeypatch.setattr(rollout_module, "VERIFY_CHUNK_TOKENS", 2 * B)
    monkeypatch.setattr(rollout_module, "VERIFY_FORWARD_CHUNKS", 2)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_chunked_verifier_equals_engine_verification(arch, small_chunks):
    """The linear verifier pass over the live blocks == the engine's verification of each block,
    float32, atol 1e-4 (as the dense pass above)."""
    target = tiny_target(arch)
    layer_ids = (0, 1, 2)
    batch = random_batch(lengths=(40, 27, 33, 38), anchors=5)
    batch.live[0, 1] = False  # a dead block inside a run of live ones
    _, cache = context_forward(target, batch.ids, layer_ids, keep_cache=True)
    T = cache.get_seq_length()
    tokens = torch.randint(4, TINY_VOCAB, (*batch.anchors.shape, B), generator=torch.Generator().manual_seed(1))
    tokens[..., 0] = batch.ids.gather(1, batch.anchors)
    rows = batch.live.nonzero(as_tuple=True)[0]
    packed = verify_chunked(target, cache, layer_ids, rows, batch.anchors[batch.live], tokens[batch.live])
    assert cache.get_seq_length() == T
    for k, (i, j) in enumerate(batch.live.nonzero().tolist()):
        s = int(batch.anchors[i, j])
        engine_cache = DynamicCache(config=target.config)
        target(input_ids=batch.ids[i:i + 1, :s], past_key_values=engine_cache, use_cache=True)
        out = target(input_ids=tokens[i:i + 1, j], position_ids=torch.arange(s, s + B)[None],
                     past_key_values=engine_cache, use_cache=True, output_hidden_states=True)
        torch.testing.assert_close(packed[k], target_features(out.hidden_states, layer_ids)[0], atol=1e-4, rtol=0)
    assert packed.shape[0] == int(batch.live.sum()) >= 15


def test_chunked_drafter_logits_equal_the_dense_reference(small_chunks):
    """Chunked block attention over the live blocks == the dense mask over every block slot:
    the same draft logits (float32), dead slots included in the batch."""
    target = tiny_target("qwen3")
    d = drafter_for(target)
    batch = random_batch(lengths=(40, 12, 33), anchors=6, seed=3)  # the short sequence has dead slots
    feats, _ = context_forward(target, batch.ids, d.cfg.target_layer_ids, keep_cache=False)
    b, T = batch.ids.shape
    ctx_kv = d.dflash.context_kv(d.dflash.project(feats), torch.arange(T).expand(b, T))
    x = torch.randn(int(batch.live.sum()), B, d.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    logits = [apply_head(target.lm_head, Rollout(d, TargetParts(target, d.cfg.target_layer_ids), 0, False, ref)
                         ._draft_live(x, batch.anchors, batch.live, ctx_kv)) for ref in (True, False)]
    assert not batch.live.all()
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=0)


def rollout_step(target, batch, rounds, relay, keep_cache, block_bias=0.0, **kwargs):
    """A fresh drafter's training step on `batch` through `Rollout(..., **kwargs)` -> (loss, stats,
    gradients by parameter name, the drafter)."""
    d = drafter_for(target)
    feats, cache = context_forward(target, batch.ids, d.cfg.target_layer_ids, keep_cache=keep_cache)
    rollout = Rollout(d, TargetParts(target, d.cfg.target_layer_ids), rounds, relay, **kwargs)
    rollout.block_bias = block_bias
    loss, stats = rollout(batch, feats, cache)
    loss.backward()
    return loss.detach(), stats, {n: p.grad for n, p in d.named_parameters() if p.grad is not None}, d


def assert_same_step(ref, other):
    """Two `rollout_step` results agree (float32): loss, statistics and every gradient."""
    (loss_ref, stats_ref, grads_ref, _), (loss, stats, grads, _) = ref, other
    torch.testing.assert_close(loss, loss_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stats, stats_ref, atol=1e-4, rtol=1e-5)
    assert grads.keys() == grads_ref.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], grads_ref[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("chunks", ["small", "default"])
@pytest.mark.parametrize("rounds, relay", [(0, False), (2, True), (2, False)])
def test_linear_layout_equals_the_dense_reference(rounds, relay, chunks, request):
    """Chunked block attention, the chunked verifier pass and the chunked head + loss give the
    dense reference's loss, statistics and gradients (float32) on the same batch."""
    if chunks == "small":
        request.getfixturevalue("small_chunks")
    target = tiny_target("llama")
    batch = random_batch(lengths=(40, 27, 33), anchors=6, seed=2)
    (_, _, grads, d), (_, stats, _, _) = results = [rollout_step(target, batch, rounds, relay, relay, reference=ref)
                                                    for ref in (True, False)]
    assert_same_step(*results)
    assert len(grads) >= len(list(d.dflash.parameters()))
    assert (stats[1:, STATS.index("anchors")] > 0).all()  # later rounds ran on live blocks


def test_block_bias_is_the_same_in_both_layouts_and_only_touches_anchor_keys(small_chunks):
    """`--block-bias`: the linear layout's chunks and the dense reference add it alike (same loss and
    gradients, float32); it changes the loss; at 0 the masks are the plain boolean ones; it lands on
    the visible anchor keys only (context keys and the blocks' other keys unchanged)."""
    inf = float("-inf")
    mask = torch.tensor([[True, False, True, True, False, False],    # context 2, two blocks of B = 2
                         [True, True, False, False, True, True]])
    assert bias_anchor_keys(mask, 2, 2, 0.0) is mask
    assert bias_anchor_keys(mask, 2, 2, 2.5).tolist() == [[0, inf, 2.5, 0, inf, inf], [0, 0, inf, inf, 2.5, 0]]
    target = tiny_target("llama")
    batch = random_batch(lengths=(40, 27, 33), anchors=6, seed=2)
    ref, linear, plain = (rollout_step(target, batch, 0, False, False, block_bias=bias, reference=reference)
                          for reference, bias in ((True, 3.0), (False, 3.0), (False, 0.0)))
    assert_same_step(ref, linear)
    assert abs(float(plain[0]) - float(linear[0])) > 1e-4


def test_block_bias_falls_to_zero_over_its_steps():
    assert [block_bias(s, 5, 4.0) for s in (0, 1, 4, 5, 9)] == pytest.approx([4.0, 3.2, 0.8, 0.0, 0.0])


@pytest.mark.parametrize("kind", ["ce", "kl"])
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_head_loss_equals_the_full_logits_one(bias, kind, monkeypatch):
    """Values, argmax and the gradient w.r.t. the hidden states equal full-vocabulary logits + the
    loss (float32: CE on labels, or `--loss kl`'s cross entropy to the teacher states' distribution);
    no logits wider than a chunk are ever formed."""
    head = torch.nn.Linear(16, 300, bias=bias).requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    head.weight.copy_(torch.randn(300, 16, generator=g))
    if bias:
        head.bias.copy_(torch.randn(300, generator=g))
    hidden = torch.randn(37, 16, generator=g, requires_grad=True)
    labels = torch.randint(0, 300, (37,), generator=g)
    teacher = torch.randn(37, 16, generator=g) if kind == "kl" else None
    upstream = torch.rand(37, generator=g)
    ce_ref, guess_ref = draft_loss(head, hidden, labels, teacher, reference=True)
    (grad_ref,) = torch.autograd.grad((ce_ref * upstream).sum(), hidden)
    widest = []
    linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda x, *a: widest.append(x.shape[0]) or linear(x, *a))
    ce, guess = draft_loss(head, hidden, labels, teacher, chunk=8)
    (grad,) = torch.autograd.grad((ce * upstream).sum(), hidden)
    assert max(widest) == 8 and sum(widest) == 37 * (2 if kind == "kl" else 1)  # kl: the teacher's logits too
    torch.testing.assert_close(ce, ce_ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(guess, guess_ref)
    torch.testing.assert_close(grad, grad_ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="frozen head"):
        draft_loss(head.requires_grad_(True), hidden, labels, teacher)


def test_chunked_head_loss_in_bfloat16_is_close_to_the_full_one():
    """A bfloat16 head (the bf16 recipe): same loss and gradient up to bfloat16 rounding."""
    head = torch.nn.Linear(32, 500, bias=False).requires_grad_(False)
    g = torch.Generator().manual_seed(1)
    head.weight.copy_(torch.randn(500, 32, generator=g) * 0.3)
    head.to(torch.bfloat16)
    hidden = torch.randn(70, 32, generator=g, requires_grad=True)
    labels = torch.randint(0, 500, (70,), generator=g)
    (ce_ref, _), (ce, _) = full_cross_entropy(head, hidden, labels), chunked_cross_entropy(head, hidden, labels, 16)
    (grad_ref,), (grad,) = torch.autograd.grad(ce_ref.sum(), hidden), torch.autograd.grad(ce.sum(), hidden)
    torch.testing.assert_close(ce, ce_ref, atol=0.02, rtol=0.01)
    torch.testing.assert_close(grad, grad_ref, atol=0.02, rtol=0.02)


@pytest.mark.parametrize("relay", [True, False])
def test_a_round_with_no_live_anchor_is_a_valid_round(relay):
    """Each sequence supervises only its last 2 tokens: one anchor, which stops after round 0, so
    rounds 1 and 2 hold no live block. They are valid rounds: zero loss, zero counts, no NaN."""
    target = tiny_target("llama")
    g = torch.Generator().manual_seed(0)
    seqs = []
    for n in (12, 9):
        mask = torch.zeros(n, dtype=torch.bool)
        mask[-2:] = True
        seqs.append((torch.randint(4, TINY_VOCAB, (n,), generator=g), mask))
    batch = collate(seqs, [sample_anchors(m, 4, g) for _, m in seqs])
    d = drafter_for(target)
    loss, stats = run_rollout(target, d, 2, relay, batch)
    assert torch.isfinite(loss) and torch.isfinite(stats).all()
    assert stats[0, STATS.index("anchors")] == 2 and (stats[1:] == 0).all()
    torch.testing.assert_close(loss.detach(), stats[0, 0] / stats[0, 1])  # L(1) = L(2) = 0
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in d.dflash.parameters())


def test_compiled_rollout_gives_the_eager_loss_and_gradients():
    """`Rollout(compile=True)` (`dflow train --compile`: the drafter's layers around their attention
    and the loss's passes over the vocabulary, through torch.compile) changes no value: the same
    loss, statistics and gradients as eager (float32), over rounds whose numbers of live blocks
    differ (dynamic shapes)."""
    target = tiny_target("llama")
    batch = random_batch(lengths=(40, 27, 33), anchors=6, seed=2)
    results = [rollout_step(target, batch, 2, True, True, compile=compiled) for compiled in (False, True)]
    assert [r[3].dflash.compiled is not None for r in results] == [False, True]
    assert_same_step(*results)


def test_chunks_grow_on_a_gpu_only():
    """A GPU takes chunks GPU_CHUNK_SCALE times a CPU's: at the defaults, all 128 blocks of 16 of a
    sequence in one drafter chunk (fewer kernels a step), the CPU's sizes unchanged."""
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert rollout_module.chunk_size(rollout_module.DRAFT_CHUNK_TOKENS, cpu) == rollout_module.DRAFT_CHUNK_TOKENS
    assert rollout_module.chunk_size(rollout_module.DRAFT_CHUNK_TOKENS, gpu) // 16 >= 128
    assert rollout_module.chunk_size(7, gpu) == 7 * rollout_module.GPU_CHUNK_SCALE


def test_one_chunk_a_sequence_gives_the_same_loss(monkeypatch):
    """The rollout's loss and gradient with a sequence's blocks in one chunk (a GPU's sizes) equal
    those with the CPU's small chunks, float32, atol 1e-5."""
    target = tiny_target("llama")
    torch.manual_seed(0)
    drafter = DFlowDrafter(config_for_target(target.config, 1, B, mask_token_id=3)).init_weights(0)
    batch = random_batch(lengths=(40, 27, 33, 38), anchors=5)
    results = []
    for scale in (1, 64):
        monkeypatch.setattr(rollout_module, "DRAFT_CHUNK_TOKENS", 2 * B * scale)
        rollout = Rollout(drafter, TargetParts(target, drafter.cfg.target_layer_ids), 0, False)
        features, cache = context_forward(target, batch.ids, drafter.cfg.target_layer_ids, keep_cache=False)
        drafter.zero_grad()
        loss, _ = rollout(batch, features, cache)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in drafter.parameters() if p.grad is not None]))
    assert torch.allclose(results[0][0], results[1][0], atol=1e-5)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(results[0][1], results[1][1]))


@pytest.mark.parametrize("rounds, relay", [(0, False), (2, True)])
def test_the_dense_drafter_layout_gives_the_chunked_loss_and_gradients(rounds, relay, monkeypatch):
    """`Rollout(dense=True)` (a GPU's default: one masked drafter call over all block slots of the
    batch a round, one verifier forward over them a relayed round) gives the chunked layout's loss,
    statistics and gradients, float32, with the chunked loss."""
    target = tiny_target("llama")
    batch = random_batch(lengths=(40, 27, 33), anchors=6, seed=4)
    dense_calls, draft, verify = [], Rollout._draft, rollout_module.verify_blocks
    monkeypatch.setattr(Rollout, "_draft", lambda self, *a: dense_calls.append("draft") or draft(self, *a))
    monkeypatch.setattr(rollout_module, "verify_blocks", lambda *a: dense_calls.append("verify") or verify(*a))
    results = []
    for dense in (False, True):
        results.append(rollout_step(target, batch, rounds, relay, relay, dense=dense))
        # one batched drafter call a round, one batched verifier pass a relayed round
        assert dense_calls.count("draft") == (rounds + 1 if dense else 0)
        assert dense_calls.count("verify") == (rounds if dense and relay else 0)
    assert_same_step(*results)
    assert Rollout(results[0][3], TargetParts(target, (1,)), 0, False).dense is None  # auto: dense on CUDA only
