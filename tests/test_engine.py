"""The decode loop is lossless: every method reproduces the target's own greedy decoding."""

from __future__ import annotations

import pytest
import torch

from conftest import ARCHS, TINY_VOCAB, tiny_target
from dflow.engine import generate
from dflow.errors import DFlowError
from dflow.model import DFlowDrafter, config_for_target
from dflow.proposers import DrafterProposer, OracleProposer

PROMPT_LENGTHS = (1, 2, 5, 16, 17, 63, 200)
MAX_NEW = (1, 2, 7, 15, 16, 17, 33, 70)
B = 8


def random_drafter(target, seed=1, relay_scale=0.5):
    """A random drafter whose relay is NOT a no-op, so relay on/off paths really differ."""
    d = DFlowDrafter(config_for_target(target.config, 2, B, mask_token_id=3)).init_weights(seed, std=0.3)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        w = d.relay.mlp[2].weight
        w.copy_(torch.randn(w.shape, generator=g) * relay_scale)
    return d.eval()


def hf_greedy(target, prompt, max_new, eos=None):
    ids = torch.tensor([prompt])
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                          eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def prompts(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randint(4, TINY_VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS}


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_lossless_every_method(arch):
    target = tiny_target(arch)
    drafter = random_drafter(target)
    for n, prompt in prompts().items():
        ref = hf_greedy(target, prompt, max(MAX_NEW))
        for max_new in MAX_NEW:
            expect = ref[:max_new]
            runs = {
                "ar": generate(target, prompt, max_new_tokens=max_new),
                "dflash": generate(target, prompt, proposer=DrafterProposer(drafter, target, use_relay=False),
                                   block_size=B, max_new_tokens=max_new),
                "dflow": generate(target, prompt, proposer=DrafterProposer(drafter, target, use_relay=True),
                                  block_size=B, max_new_tokens=max_new),
                "oracle": generate(target, prompt, proposer=OracleProposer(prompt + ref, TINY_VOCAB),
                                   block_size=B, max_new_tokens=max_new),
            }
            for method, r in runs.items():
                assert r.token_ids == expect, (arch, method, n, max_new)
                assert sum(x.committed for x in r.rounds) + 1 == len(r.token_ids)
            oracle = runs["oracle"].rounds
            assert all(x.committed == B for x in oracle[:-1]), [x.committed for x in oracle]


def test_oracle_tau_is_block_size():
    target = tiny_target("qwen3")
    prompt = prompts()[17]
    ref = hf_greedy(target, prompt, 1 + 5 * 16 + 3)
    r = generate(target, prompt, proposer=OracleProposer(prompt + ref, TINY_VOCAB), block_size=16,
                 max_new_tokens=len(ref))
    assert r.token_ids == ref
    assert [x.accepted for x in r.rounds] == [15] * 5 + [2]
    assert r.tau == pytest.approx((5 * 16 + 3) / 6)


@pytest.mark.parametrize("method", ["ar", "dflash", "dflow", "oracle"])
def test_stop_tokens_even_inside_an_accepted_block(method):
    target = tiny_target("llama")
    drafter = random_drafter(target)
    prompt = prompts()[5]
    ref = hf_greedy(target, prompt, 70)
    stop = ref[20]  # a token the target does emit; may also occur earlier
    expect = hf_greedy(target, prompt, 70, eos=stop)
    assert expect[-1] == stop and len(expect) <= 21
    proposer = {"ar": None, "dflash": DrafterProposer(drafter, target, False),
                "dflow": DrafterProposer(drafter, target, True),
                "oracle": OracleProposer(prompt + ref, TINY_VOCAB)}[method]
    r = generate(target, prompt, proposer=proposer, block_size=B, max_new_tokens=70, stop_token_ids=[stop])
    assert r.token_ids == expect and r.stopped


class _Identity(torch.nn.Module):
    """Stands in for the relay MLP: the relayed input is exactly the projected verifier state."""

    def forward(self, mask_embed, bonus_embed, rejected_embed, h):
        return h


def test_relay_index_shift():
    """The verifier state at old block index a+k becomes the next block's input at new index k;
    nothing is relayed when a = B-1, nor in the first round."""
    target = tiny_target("llama")
    prompt = prompts()[16]
    ref = hf_greedy(target, prompt, 60)
    drafter = random_drafter(target)
    proposer = DrafterProposer(drafter, target, use_relay=True)
    proposer.relay_module = _Identity()
    # Drafts: the oracle's, corrupted at a chosen index per round -> known accepted counts.
    wrong_at = iter([3, 8, 1, 8, 6, 8, 8, 8, 8])  # 8 = no corruption: a = B-1
    verify_feats, block_inputs, accepted_seen = [], [], []
    original_propose, model_forward = proposer.propose, proposer.model.forward

    def propose(anchor, start, size):
        logits = OracleProposer(prompt + ref, TINY_VOCAB).propose(anchor, start, size)
        j = next(wrong_at)
        if j < size:
            tok = logits[0, j - 1].argmax()
            logits[0, j - 1, tok] = -1e4
            logits[0, j - 1, (tok + 1) % TINY_VOCAB] = 1e4
        original_propose(anchor, start, size)  # runs the drafter: records its block inputs
        return logits

    def spy_forward(x, positions, ctx_kv, mask=None):
        block_inputs.append(x.clone())
        return model_forward(x, positions, ctx_kv, mask)

    def spy_target(module, args, kwargs, output):
        if output.hidden_states is not None and kwargs.get("position_ids") is not None:  # verify, not prefill
            verify_feats.append(torch.cat([output.hidden_states[i + 1] for i in proposer.layer_ids], -1))

    proposer.propose, proposer.model.forward = propose, spy_forward
    handle = target.register_forward_hook(spy_target, with_kwargs=True)
    try:
        r = generate(target, prompt, proposer=proposer, block_size=B, max_new_tokens=60)
    finally:
        handle.remove()
    assert r.token_ids == ref
    accepted_seen = r.accepted
    assert accepted_seen[:4] == [2, 7, 0, 7]
    mask_embed = target.get_input_embeddings().weight[3]
    first = block_inputs[0]
    assert torch.equal(first[0, 1:], mask_embed.expand(B - 1, -1))  # first round: plain masks
    for rnd in range(1, len(block_inputs)):
        a, x = accepted_seen[rnd - 1], block_inputs[rnd]
        size = x.shape[1]
        with torch.inference_mode():
            relayed = proposer.model.project(verify_feats[rnd - 1])  # [1, V, hidden], old indices
        for k in range(1, size):
            if a < B - 1 and a + k < verify_feats[rnd - 1].shape[1]:
                torch.testing.assert_close(x[0, k], relayed[0, a + k])  # old a+k -> new k
            else:
                assert torch.equal(x[0, k], mask_embed)  # nothing relayed: plain mask


def test_engine_rejects_bad_prompts():
    target = tiny_target("llama")
    with pytest.raises(DFlowError, match="empty"):
        generate(target, [], max_new_tokens=4)
    with pytest.raises(DFlowError, match="context"):
        generate(target, [5] * 512, max_new_tokens=4)
    # a prompt that nearly fills the context: generation is clamped, not an error
    r = generate(target, [5] * 510, max_new_tokens=10)
    assert len(r.token_ids) == 2
