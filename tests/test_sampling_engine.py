"""Sampling end to end: speculative decoding at T > 0 keeps the target's distribution exactly.

What is tested (chi-square goodness of fit, pass: p > 0.01): the first 3 generated tokens of a
tiny random target (vocab 50) against plain target sampling, computed exactly by enumeration
(token 1 from the prompt, token 2 given token 1, token 3 given both: 1 + 50 + 2500 sequences).
Each of positions 1, 2 and 3 is tested marginally, and the joint of the 3 tokens too, with cells
expected fewer than 5 times pooled into one.

Two harnesses, both going through the engine's acceptance code (`sampling.draft_tokens`,
`sampling.accept`), never a re-implementation of it:
- `batched_first_tokens`: 20,000 runs at once, the engine's rounds on batched tensors, with a
  deliberately bad drafter (a random table, history dependent like the relay) and the real target.
- `engine_first_tokens`: a few hundred real `engine.generate` runs with a bad random DFlow drafter
  (relay on) via `DrafterProposer`: fewer samples, so a looser test, which still catches a broken rule.
Negative cases: with `rejection_accept` patched to always accept, or to draw the token after a
rejection from p instead of the residual norm(max(0, p - q)), the same tests give p < 0.01.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import tiny_target
from stats import chi_square_pvalue

from dflow import sampling
from dflow.cli import main
from dflow.engine import SamplingParams, generate
from dflow.model import DFlowDrafter, config_for_target
from dflow.proposers import DrafterProposer

VOCAB = 50
PROMPT = [5, 17, 33, 8, 21]
N_BATCHED = 20_000
N_ENGINE = 400
K = 3  # drafts per round (block size 4)
ALPHA = 0.01
MIN_EXPECTED = 5
CONFIGS = [  # temperature, top_k, top_p
    (0.7, 0, 1.0),
    (1.0, 0, 1.0),
    (0.7, 10, 1.0),
    (1.0, 0, 0.8),
    (1.0, 12, 0.9),
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny forwards run ~10x faster on one thread than on two contended ones."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", vocab=VOCAB, layers=2)


@pytest.fixture(scope="module")
def target_logits(target):
    """Logits for token 1 [vocab], token 2 given t1 [vocab, vocab], token 3 given t1, t2 [vocab^2, vocab]."""
    n, v = len(PROMPT), torch.arange(VOCAB)
    with torch.inference_mode():
        seqs = torch.cat([torch.tensor(PROMPT).expand(VOCAB * VOCAB, n), v.repeat_interleave(VOCAB)[:, None],
                          v.repeat(VOCAB)[:, None]], dim=1)  # [vocab^2, n+2]: prompt, t1, t2
        logits = target(input_ids=seqs).logits.float()
    return logits[0, n - 1], logits[::VOCAB, n], logits[:, n + 1]


def exact_joint(target_logits, temperature, top_k, top_p) -> torch.Tensor:  # [vocab, vocab, vocab]
    """Plain target sampling's joint of tokens 1..3: p(t1) p(t2 | t1) p(t3 | t1, t2)."""
    p1, p2, p3 = (sampling.sampling_probs(x, temperature, top_k, top_p).double() for x in target_logits)
    return p1[:, None, None] * p2[:, :, None] * p3.view(VOCAB, VOCAB, VOCAB)


def pvalues(tokens: torch.Tensor, joint: torch.Tensor) -> dict[str, float]:
    """tokens [runs, 3] -> chi-square p-values of positions 1, 2, 3 and of the joint."""
    counts = torch.zeros(VOCAB ** 3, dtype=torch.float64)
    counts.index_add_(0, (tokens[:, 0] * VOCAB + tokens[:, 1]) * VOCAB + tokens[:, 2],
                      torch.ones(len(tokens), dtype=torch.float64))
    counts = counts.view(VOCAB, VOCAB, VOCAB)
    out = {f"t{i + 1}": chi_square_pvalue(counts.sum(other), joint.sum(other), MIN_EXPECTED)
           for i, other in enumerate([(1, 2), (0, 2), (0, 1)])}
    out["joint"] = chi_square_pvalue(counts, joint, MIN_EXPECTED)
    return out


# ---- 20,000 runs at once: the engine's rounds on batched tensors ---------------------------------

def table_drafter(seed: int = 7, scale: float = 2.0):
    """A deliberately bad drafter: q_j depends on the anchor, the block index and, like DFlow's
    relay, on the previous round's first rejected draft; random, so far from p."""
    g = torch.Generator().manual_seed(seed)
    by_anchor = torch.randn(VOCAB, K, VOCAB, generator=g) * scale  # [anchor, j, vocab]
    by_rejected = torch.randn(VOCAB + 1, 1, VOCAB, generator=g) * scale  # [rejected (VOCAB: none), 1, vocab]
    return lambda anchor, rejected: by_anchor[anchor] + by_rejected[rejected]  # [m, K, vocab]


@torch.inference_mode()
def batched_first_tokens(target, params: SamplingParams, runs: int, drafter=None) -> torch.Tensor:
    """The first 3 tokens of `runs` independent generations [runs, 3]: prefill, then rounds of
    draft -> verify (full forward, no cache) -> accept -> commit, as in `engine.generate`."""
    drafter = drafter or table_drafter()
    T, k, p, rule = params.temperature, params.top_k, params.top_p, params.rule
    gen = torch.Generator().manual_seed(params.seed)
    prompt = torch.tensor(PROMPT)
    n = len(prompt)
    prefill = target(input_ids=prompt[None]).logits[:, -1:].float().expand(runs, 1, VOCAB)
    _, first = sampling.accept(prompt.new_zeros(runs, 0), None, prefill, T, k, p, gen, rule)
    seq = torch.zeros(runs, 3 + K, dtype=torch.long)  # committed tokens (room for one more round)
    seq[:, 0], length = first, torch.ones(runs, dtype=torch.long)
    rejected = torch.full((runs,), VOCAB)  # the previous round's first rejected draft (none yet)
    while (length < 3).any():
        L = int(length[length < 3].min())
        rows = (length == L).nonzero().squeeze(1)  # [m]: a group of equal length
        m = len(rows)
        # 1. Draft from q; 2. verify [anchor, d_1..d_K]; 3. accept.
        draft, q = sampling.draft_tokens(drafter(seq[rows, L - 1], rejected[rows]), T, k, p, gen)  # [m, K]
        ids = torch.cat([prompt.expand(m, n), seq[rows, :L], draft], dim=1)  # [m, n+L+K]
        logits = target(input_ids=ids).logits[:, n + L - 1:].float()  # [m, K+1, vocab]
        accepted, next_token = sampling.accept(draft, q, logits, T, k, p, gen, rule)  # [m], [m]
        # 4. Commit d_1..d_a and the next token.
        j = torch.arange(K + 1)
        padded = torch.cat([draft, draft[:, :1]], dim=1)  # [m, K+1]: index K is never taken from here
        new = torch.where(j < accepted[:, None], padded, next_token[:, None])
        keep = j <= accepted[:, None]  # [m, K+1]
        seq[rows[:, None].expand(-1, K + 1)[keep], (L + j).expand(m, -1)[keep]] = new[keep]
        length[rows] = L + accepted + 1
        rejected[rows] = torch.where(accepted < K, draft.gather(1, accepted.clamp(max=K - 1)[:, None]).squeeze(1),
                                     VOCAB)
    return seq[:, :3]


def always_accept(draft_ids, draft_probs, target_probs, generator):
    """A broken rule: every draft accepted, the bonus from p_K."""
    K_ = draft_ids.shape[1]
    return draft_ids.new_full((draft_ids.shape[0],), K_), sampling.sample(target_probs[:, K_], generator)


def recover_from_p(rejection_accept):
    """A subtly broken rule: the token after a rejection drawn from p, not from the residual."""
    def rule(draft_ids, draft_probs, target_probs, generator):
        accepted, next_token = rejection_accept(draft_ids, draft_probs, target_probs, generator)
        from_p = sampling.sample(target_probs[torch.arange(len(accepted)), accepted], generator)
        return accepted, torch.where(accepted < draft_ids.shape[1], from_p, next_token)
    return rule


@pytest.mark.parametrize("temperature, top_k, top_p", CONFIGS)
def test_batched_runs_follow_target(target, target_logits, temperature, top_k, top_p):
    params = SamplingParams(temperature, top_k, top_p, seed=1)
    tokens = batched_first_tokens(target, params, N_BATCHED)
    result = pvalues(tokens, exact_joint(target_logits, temperature, top_k, top_p))
    assert min(result.values()) > ALPHA, result


def test_batched_runs_match_rule_follow_target(target, target_logits):
    params = SamplingParams(1.0, 0, 1.0, rule="match", seed=2)
    result = pvalues(batched_first_tokens(target, params, N_BATCHED), exact_joint(target_logits, 1.0, 0, 1.0))
    assert min(result.values()) > ALPHA, result


def test_batched_bad_drafter_is_really_bad(target):
    """The drafter is far from the target, so acceptance is a real coin flip, not a formality."""
    tokens = batched_first_tokens(target, SamplingParams(1.0, seed=3), 2000)
    anchor = tokens[:, 0]
    q = sampling.sampling_probs(table_drafter()(anchor, torch.full_like(anchor, VOCAB))[:, 0], 1.0)
    with torch.inference_mode():
        p = target(input_ids=torch.cat([torch.tensor(PROMPT).expand(2000, -1), anchor[:, None]], 1)).logits[:, -1]
    overlap = torch.minimum(q, p.softmax(-1)).sum(-1).mean()  # P(accept d_1)
    assert 0.1 < overlap < 0.7, overlap


@pytest.mark.parametrize("broken", ["always_accept", "recover_from_p"])
@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 10, 1.0)])
def test_batched_runs_catch_broken_rule(target, target_logits, temperature, top_k, top_p, broken, monkeypatch):
    rule = always_accept if broken == "always_accept" else recover_from_p(sampling.rejection_accept)
    monkeypatch.setattr(sampling, "rejection_accept", rule)
    tokens = batched_first_tokens(target, SamplingParams(temperature, top_k, top_p, seed=1), N_BATCHED)
    result = pvalues(tokens, exact_joint(target_logits, temperature, top_k, top_p))
    assert result["t1"] > ALPHA  # the prefill has no drafts: still right
    assert result["t2"] < ALPHA and result["t3"] < ALPHA and result["joint"] < ALPHA, result


# ---- real engine runs ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bad_drafter(target):
    """A random DFlow drafter (1 layer, block 4) with a relay that is not a no-op. Weights at 15x
    the init scale put q far from p; a final norm at 0.3x keeps d_1 accepted ~45% of the time at T = 1."""
    d = DFlowDrafter(config_for_target(target.config, 1, K + 1, mask_token_id=3)).init_weights(1, std=0.3)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        d.dflash.norm.weight.mul_(0.3)
        w = d.relay.mlp[2].weight
        w.copy_(torch.randn(w.shape, generator=g) * 0.5)
    return d.eval()


def engine_first_tokens(target, drafter, params: SamplingParams, runs: int, relay: bool = True):
    """The first 3 tokens [runs, 3] of `runs` engine generations, seeds seed..seed+runs-1.
    max_new_tokens 5 so round 1 drafts 3 tokens and, after a rejection, round 2 drafts with the relay.
    Also returns how many drafts round 1 accepted [runs]."""
    tokens, accepted = [], []
    for i in range(runs):
        p = SamplingParams(params.temperature, params.top_k, params.top_p, params.rule, params.seed + i)
        r = generate(target, PROMPT, proposer=DrafterProposer(drafter, target, use_relay=relay),
                     block_size=K + 1, max_new_tokens=5, params=p)
        tokens.append(r.token_ids[:3])
        accepted.append(r.rounds[0].accepted)
    return torch.tensor(tokens), torch.tensor(accepted)


@pytest.mark.parametrize("temperature, top_k, top_p, relay", [(1.0, 0, 1.0, True), (1.0, 0, 0.8, False)])
def test_engine_runs_follow_target(target, target_logits, bad_drafter, temperature, top_k, top_p, relay):
    tokens, accepted = engine_first_tokens(target, bad_drafter, SamplingParams(temperature, top_k, top_p, seed=0),
                                           N_ENGINE, relay)
    assert 0.15 < (accepted > 0).float().mean() < 0.85  # both acceptance and rejection are exercised
    joint = exact_joint(target_logits, temperature, top_k, top_p)
    result = pvalues(tokens, joint)
    result.pop("joint")  # too few runs for 125,000 cells
    assert min(result.values()) > ALPHA, result


def test_engine_runs_with_a_reduced_draft_vocabulary_follow_target(target, target_logits, bad_drafter):
    """A drafter over 25 of the 50 ids (dflow.vocab): its q is zero on the other 25, where p is not,
    and the committed tokens still follow the target."""
    d2t = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(2))[:25].sort().values  # [25]
    small = DFlowDrafter(replace(bad_drafter.cfg, draft_vocab_size=25))
    small.load_state_dict({**bad_drafter.state_dict(), "dflash.d2t": d2t})
    tokens, accepted = engine_first_tokens(target, small.eval(), SamplingParams(1.0, seed=0), N_ENGINE)
    assert 0.15 < (accepted > 0).float().mean() < 0.85
    result = pvalues(tokens, exact_joint(target_logits, 1.0, 0, 1.0))
    result.pop("joint")
    assert min(result.values()) > ALPHA, result


def test_engine_runs_catch_always_accept(target, target_logits, bad_drafter, monkeypatch):
    monkeypatch.setattr(sampling, "rejection_accept", always_accept)
    tokens, _ = engine_first_tokens(target, bad_drafter, SamplingParams(1.0, seed=0), N_ENGINE)
    result = pvalues(tokens, exact_joint(target_logits, 1.0, 0, 1.0))
    assert result["t2"] < ALPHA and result["t3"] < ALPHA, result


# ---- greedy fallback and seeds ---------------------------------------------------------------------

def test_temperature_zero_is_the_greedy_path(target, bad_drafter):
    prompt = PROMPT * 3
    ids = torch.tensor([prompt])
    greedy = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=30,
                             eos_token_id=None, pad_token_id=0)
    expect = greedy[0, len(prompt):].tolist()
    assert len(expect) == 30
    for relay in (False, True):
        for params in (SamplingParams(), SamplingParams(0.0, 5, 0.5, "match", seed=3),
                       SamplingParams(0.0, 0, 1.0, "rejection", seed=4)):
            r = generate(target, prompt, proposer=DrafterProposer(bad_drafter, target, relay), block_size=K + 1,
                         max_new_tokens=30, params=params)
            assert r.token_ids == expect, (relay, params)
    assert generate(target, prompt, max_new_tokens=30, params=SamplingParams(0.0, seed=9)).token_ids == expect


@pytest.mark.parametrize("rule", ["rejection", "match"])
def test_seed_reproduces(target, bad_drafter, rule):
    def run(seed, method):
        proposer = None if method == "ar" else DrafterProposer(bad_drafter, target, method == "dflow")
        return generate(target, PROMPT, proposer=proposer, block_size=K + 1, max_new_tokens=24,
                        params=SamplingParams(1.0, 20, 0.95, rule, seed)).token_ids

    for method in ("ar", "dflash", "dflow"):
        a = run(3, method)
        assert len(a) == 24 and run(3, method) == a
        assert len({tuple(run(s, method)) for s in (4, 5, 6)} | {tuple(a)}) > 1  # seeds differ


# ---- the CLI ---------------------------------------------------------------------------------------

def cli_generate(target_dir, capsys, *flags):
    rc = main(["generate", "w5 w6 w7", "--target", str(target_dir), "--dtype", "float32", "--json",
               "--max-new-tokens", "12", "--block-size", "4", *flags])
    out = capsys.readouterr()
    return rc, out


def test_cli_sampling_reproduces(tiny_target_dir, capsys):
    import json

    runs = [cli_generate(tiny_target_dir, capsys, "--temperature", "0.8", "--seed", str(s)) for s in (3, 3, 4)]
    assert [rc for rc, _ in runs] == [0, 0, 0]
    ids = [json.loads(out.out)["token_ids"] for _, out in runs]
    assert ids[0] == ids[1] and len(ids[0]) > 0
    rc, out = cli_generate(tiny_target_dir, capsys, "--temperature", "0.8", "--seed", "3", "--verify", "match",
                           "--top-k", "5", "--top-p", "0.9", "--method", "dflash")
    assert rc == 0 and json.loads(out.out)["token_ids"]


@pytest.mark.parametrize("flags, message", [
    (("--temperature", "-1"), "temperature"),
    (("--top-p", "0"), "top_p"),
    (("--top-k", "-2"), "top_k"),
])
def test_cli_bad_sampling_values(tiny_target_dir, capsys, flags, message):
    rc, out = cli_generate(tiny_target_dir, capsys, *flags)
    lines = out.err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], out.err


def test_rejection_accepts_more_than_match():
    """E[accepted d_1]: sum min(p, q) for rejection sampling >= sum p q for sample-and-match."""
    g = torch.Generator().manual_seed(0)
    draft_logits = torch.randn(4000, K, VOCAB, generator=g)
    target_logits = torch.randn(4000, K + 1, VOCAB, generator=g)
    target_logits[:, :K] += draft_logits  # a drafter that is partly right
    mean = {}
    for rule in ("rejection", "match"):
        draft, q = sampling.draft_tokens(draft_logits, 1.0, 0, 1.0, g)
        mean[rule] = sampling.accept(draft, q, target_logits, 1.0, 0, 1.0, g, rule)[0].float().mean()
    assert mean["rejection"] > mean["match"] + 0.1, mean
