"""The device check of `scripts/gpu_check.sh`: lossless decoding and a short speed comparison on one
device, with tiny random targets built on the spot (nothing is downloaded). Prints one summary
line last, `gpu_check PASS ...` or `gpu_check FAIL ...` (exit code 1).

    python scripts/gpu_check.py --device cuda     # or cpu (the test suite runs it so)

1. Lossless, float32: on random Llama, Qwen2 and Qwen3 targets (the test suite's `tiny_target`),
   `ar`, `dflash`, `dflow` (a random drafter whose relay is not a no-op) and an oracle drafter
   (real multi-token verification) must give exactly HF greedy `generate`'s tokens.
2. Speed, bfloat16: decode tokens/s of ar, dflash, dflow and the oracle on a larger random Llama,
   interleaved, with the drafter methods' tau. Random drafters accept almost nothing, so dflash and
   dflow show the cost of a round and the oracle its ceiling.
3. Training, bfloat16: seconds per step of `dflow train`'s loop (DFlash, 128 blocks per sequence)
   on a random Llama, as dflow runs it (on a GPU: dense drafter attention, and not cuDNN's kernels:
   dflow.attention.sdpa_backends), with the other drafter attention layout, at twice the batch
   (does a bigger batch cost less a sequence?), and with attention as torch would choose it (cuDNN
   first on Hopper and newer, whose per-shape plans made a step at batch 32 on an H200 take 38 s).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import ARCHS, tiny_target, tiny_tokenizer  # noqa: E402  the test suite's random targets
from test_engine import hf_greedy, random_drafter  # noqa: E402
from test_train_loop import write_data  # noqa: E402

from dflow import metrics  # noqa: E402
from dflow.engine import generate  # noqa: E402
from dflow.errors import DFlowError  # noqa: E402
from dflow.model import DFlowDrafter, config_for_target  # noqa: E402
from dflow.proposers import DrafterProposer, OracleProposer  # noqa: E402
from dflow.targets import resolve_device  # noqa: E402
from dflow.train import TrainConfig  # noqa: E402
from dflow.train import loop  # noqa: E402
from dflow.train.sharding import Dist  # noqa: E402

LOSSLESS_BLOCK = 8  # test_engine.random_drafter's block size
SPEED_SIZES = {  # hidden, layers, vocab of the speed target; new tokens per run
    "cuda": (1024, 12, 32000, 256),
    "cpu": (64, 2, 512, 48),
}


def proposers(target, drafter, sequence):
    return {"ar": None, "dflash": DrafterProposer(drafter, target, use_relay=False),
            "dflow": DrafterProposer(drafter, target, use_relay=True),
            "oracle": OracleProposer(sequence, target.config.vocab_size)}


def lossless(device: torch.device) -> list[str]:
    """-> the mismatches (empty: every method equals HF greedy everywhere) and prints the count."""
    failures, checked = [], 0
    gen = torch.Generator().manual_seed(0)
    for arch in sorted(ARCHS):
        target = tiny_target(arch).to(device)
        drafter = random_drafter(target).to(device)
        for n in (1, 7, 33):
            prompt = torch.randint(4, target.config.vocab_size, (n,), generator=gen).tolist()
            for max_new in (1, 9, 40):
                with torch.device(device):  # hf_greedy's input ids
                    ref = hf_greedy(target, prompt, max_new)
                for method, proposer in proposers(target, drafter, prompt + ref).items():
                    out = generate(target, prompt, proposer=proposer, block_size=LOSSLESS_BLOCK,
                                   max_new_tokens=max_new).token_ids
                    checked += 1
                    if out != ref:
                        failures.append(f"{arch}/{method}/prompt {n}/{max_new} tokens")
    print(f"lossless float32: {checked - len(failures)}/{checked} generations identical to HF greedy")
    return failures


def speed(device: torch.device, repeats: int) -> str:
    """bf16 decode tokens/s per method on a larger random Llama, interleaved over `repeats` runs."""
    hidden, layers, vocab, new = SPEED_SIZES[device.type]
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256), head_dim=64,
                      max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs
        target = LlamaForCausalLM(cfg).to(torch.bfloat16).eval().requires_grad_(False)
    drafter = DFlowDrafter(config_for_target(cfg, 1, 16, mask_token_id=vocab - 1)).init_weights(0)
    drafter.to(device, torch.bfloat16).eval()
    prompt = list(range(10, 42))
    ar = generate(target, prompt, max_new_tokens=new)  # warm-up; the oracle proposes ar's own output
    methods = proposers(target, drafter, prompt + ar.token_ids)
    tokens = {m: 0 for m in methods}
    seconds = {m: 0.0 for m in methods}
    rounds = {m: [] for m in methods}
    for _ in range(repeats):
        for m, proposer in methods.items():
            r = generate(target, prompt, proposer=proposer, block_size=16, max_new_tokens=new)
            tokens[m] += sum(x.committed for x in r.rounds)
            seconds[m] += r.decode_s
            rounds[m].append(r.rounds)
    rates = " ".join(f"{m} {metrics.tokens_per_s(tokens[m], seconds[m]):.0f}" for m in methods)
    taus = "/".join(f"{metrics.tau(rounds[m]):.2f}" for m in methods if m != "ar")
    return f"bf16 decode tokens/s {rates} (tau dflash/dflow/oracle {taus}; {hidden}x{layers} Llama, {new} tokens)"

TRAIN_SIZES = {  # hidden, layers, vocab of the training target; batch, steps timed
    "cuda": (576, 4, 8192, 32, 6),
    "cpu": (64, 4, 512, 2, 2),
}


def train_seconds(cfg: TrainConfig, steps: int, budget_s: float = float("inf")) -> str:
    """The median seconds of up to `steps` training steps after a first (warm-up) one, stopping once
    `budget_s` have gone (then the steps timed so far, or the warm-up step alone, marked so)."""
    trainer = loop.Trainer(cfg, Dist.setup(cfg.device), progress=False)
    times, start = [], time.perf_counter()
    for step in range(steps + 1):
        t0 = time.perf_counter()
        trainer.train_step(step)
        if cfg.device != "cpu":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if time.perf_counter() - start > budget_s:
            break
    if len(times) == 1:
        return f"{times[0]:.3f} (one step)"
    return f"{statistics.median(times[1:]):.3f}"


def training(device: torch.device) -> str:
    """bf16 seconds per training step on a random Llama and random sequences of 64 to 512 tokens:
    as dflow runs it on the device, with the other drafter attention layout (--layout: dense on a GPU,
    chunked on a CPU), at twice and four times the batch, and with attention as torch would choose it
    (at most 45 s each)."""
    hidden, layers, vocab, batch, steps = TRAIN_SIZES[device.type]
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 192), head_dim=64,
                      max_position_embeddings=1024, tie_word_embeddings=True)
    torch.manual_seed(0)
    target = LlamaForCausalLM(cfg)
    target.generation_config.eos_token_id = 2
    gen = torch.Generator().manual_seed(0)
    seqs = []
    for _ in range(4 * batch):
        n = int(torch.randint(64, 513, (), generator=gen))
        seqs.append((torch.randint(4, vocab, (n,), generator=gen).tolist(), [False] * 16 + [True] * (n - 16)))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        target.save_pretrained(tmp / "target")
        tiny_tokenizer(vocab).save_pretrained(tmp / "target")
        write_data(tmp / "data", target, tiny_tokenizer(vocab), seqs)
        run = TrainConfig(target=str(tmp / "target"), data=str(tmp / "data"), out=str(tmp / "dflow"), rounds=0,
                          batch_size=batch, anchors_per_seq=128, max_len=512, max_steps=steps + 1, warmup=1,
                          block_bias=0.0, eval_samples=0, device=str(device), save_every=10_000)
        ours = train_seconds(run, steps)
        layout = "chunked" if device.type == "cuda" else "dense"  # the other one
        other = train_seconds(replace(run, out=str(tmp / "other"), layout=layout), steps, budget_s=45)
        bigger = [train_seconds(replace(run, out=str(tmp / f"x{n}"), batch_size=n * batch), steps, budget_s=45)
                  for n in (2, 4)]
        chosen = loop.sdpa_backends
        # torch's own choice; cuDNN's plans can take tens of seconds a step, so at most 45 s of it
        loop.sdpa_backends = lambda device: contextlib.nullcontext()
        try:
            torchs = train_seconds(replace(run, out=str(tmp / "torch")), steps, budget_s=45)
        finally:
            loop.sdpa_backends = chosen
    return (f"bf16 train s/step {ours} ({layout} drafter attention {other}; batch {2 * batch}: {bigger[0]}; "
            f"batch {4 * batch}: {bigger[1]}; "
            f"torch's own SDPA choice {torchs}; batch {batch}, {hidden}x{layers} Llama)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    try:
        device = resolve_device(args.device)
    except DFlowError as e:
        print(f"gpu_check FAIL device={args.device} | {e}")
        return 1
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 for the lossless part
    t0 = time.perf_counter()
    failures = lossless(device)
    figures = f"{speed(device, args.repeats)} | {training(device)}"
    verdict = "PASS" if not failures else f"FAIL ({len(failures)} mismatches: {', '.join(failures[:5])})"
    print(f"gpu_check {verdict} device={device} | lossless ar/dflash/dflow/oracle on {', '.join(sorted(ARCHS))} | "
          f"{figures} | {time.perf_counter() - t0:.0f} s")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
