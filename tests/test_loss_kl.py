"""`--loss kl`: the cross entropy to the target's own distribution, chunked like the CE (their
equality with the full-logits forms: tests/test_train_rollout.py)."""

import pytest
import torch

from dflow.train.loss import chunked_soft_cross_entropy, full_soft_cross_entropy


def _head(rows: int, width: int, bias: bool, seed: int) -> torch.nn.Linear:
    head = torch.nn.Linear(width, rows, bias=bias).requires_grad_(False)
    g = torch.Generator().manual_seed(seed)
    head.weight.copy_(torch.randn(rows, width, generator=g))
    if bias:
        head.bias.copy_(torch.randn(rows, generator=g))
    return head


def test_soft_loss_is_kl_plus_the_target_entropy():
    """H(p, q) - H(p) = KL(p || q) >= 0, zero exactly when the draft state is the teacher's."""
    head = _head(50, 8, False, 2)
    g = torch.Generator().manual_seed(3)
    teacher = torch.randn(10, 8, generator=g)
    hidden = torch.randn(10, 8, generator=g)
    p = head(teacher).softmax(-1)
    entropy = -(p * p.log()).sum(-1)
    ce, _ = chunked_soft_cross_entropy(head, hidden, teacher, chunk=4)
    kl = (p * (p.log() - head(hidden).log_softmax(-1))).sum(-1)
    torch.testing.assert_close(ce - entropy, kl, atol=1e-5, rtol=1e-5)
    same, _ = chunked_soft_cross_entropy(head, teacher, teacher, chunk=4)
    torch.testing.assert_close(same, entropy, atol=1e-5, rtol=1e-5)


def test_chunked_soft_loss_in_bfloat16_is_close_to_the_full_one():
    head = _head(500, 32, False, 4)
    head.weight.mul_(0.3)
    head.to(torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(70, 32, generator=g, requires_grad=True)
    teacher = torch.randn(70, 32, generator=g)
    (ce_ref, _), (ce, _) = full_soft_cross_entropy(head, hidden, teacher), chunked_soft_cross_entropy(head, hidden, teacher, 16)
    (grad_ref,), (grad,) = torch.autograd.grad(ce_ref.sum(), hidden), torch.autograd.grad(ce.sum(), hidden)
    torch.testing.assert_close(ce, ce_ref, atol=0.03, rtol=0.01)
    torch.testing.assert_close(grad, grad_ref, atol=0.02, rtol=0.02)


def _kl_step(target, batch, rounds, relay, reference):
    """A `--loss kl` rollout step: the final states as teacher (layer id L - 1 after the features)."""
    from test_train_rollout import drafter_for
    from dflow.train.rollout import Rollout, TargetParts, context_forward

    d = drafter_for(target)
    L, H = target.config.num_hidden_layers, target.config.hidden_size
    feats, cache = context_forward(target, batch.ids, tuple(d.cfg.target_layer_ids) + (L - 1,), keep_cache=relay)
    rollout = Rollout(d, TargetParts(target, d.cfg.target_layer_ids), rounds, relay, reference=reference)
    loss, stats = rollout(batch, feats[..., :-H], cache, feats[..., -H:])
    loss.backward()
    return loss.detach(), stats, {n: p.grad for n, p in d.named_parameters() if p.grad is not None}, d


@pytest.mark.parametrize("rounds, relay", [(0, False), (2, True)])
def test_kl_rollout_layouts_agree_and_differ_from_ce(rounds, relay):
    """The chunked soft loss in the linear layout equals the dense reference's (loss, statistics,
    gradients); its loss is not the hard-label one, and the teacher of label i is the target's
    state at anchor + i - 1 (its logits' argmax agrees with the data's token where the data is the
    target's own greedy output)."""
    from conftest import tiny_target
    from test_train_rollout import assert_same_step, random_batch, rollout_step

    target = tiny_target("llama")
    batch = random_batch(lengths=(40, 27, 33), anchors=6, seed=2)
    assert_same_step(_kl_step(target, batch, rounds, relay, True), _kl_step(target, batch, rounds, relay, False))
    kl_loss, ce_loss = _kl_step(target, batch, rounds, relay, False)[0], rollout_step(target, batch, rounds, relay, relay)[0]
    assert torch.isfinite(kl_loss) and not torch.isclose(kl_loss, ce_loss)


def test_teacher_states_are_one_position_before_each_label():
    from dflow.train.batching import teacher_states

    b, T, H, B = 2, 12, 3, 4
    teacher = torch.arange(b * T, dtype=torch.float32).view(b, T, 1).expand(b, T, H)  # value = row * T + position
    anchors = torch.tensor([[1, 9], [4, 10]])
    live = torch.tensor([[True, True], [False, True]])
    got = teacher_states(teacher, anchors, live, B)[:, 0].view(-1, B - 1)
    want = torch.tensor([[1, 2, 3], [9, 10, 11], [T + 10, T + 11, T + 11]], dtype=torch.float32)  # clamped past the end
    assert torch.equal(got, want)
