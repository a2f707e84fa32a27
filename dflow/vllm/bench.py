"""The serving benchmark's client side (no vLLM import): concurrent chat requests against a running
OpenAI-compatible server, and vLLM's own spec-decode counters read from its Prometheus `/metrics`.

Glossary (vLLM's counters, per engine): `num_drafts` = decode rounds that verified drafts,
`num_draft_tokens` = drafts proposed, `num_accepted_tokens` = drafts accepted,
`num_accepted_tokens_per_pos[j]` = rounds whose draft j+1 was accepted. tau (docs/DESIGN.md) = 1 +
accepted / drafts: committed tokens per decode round, bonus included.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from dflow import metrics

SPEC_PREFIX = "vllm:spec_decode_"
_LINE = re.compile(r'^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+([-+0-9.eEinfa]+)$')
_POSITION = re.compile(r'position="(\d+)"')


def spec_counters(metrics_text: str) -> dict:
    """Prometheus text -> {"num_drafts", "num_draft_tokens", "num_accepted_tokens": float,
    "accepted_per_pos": [float]} summed over engines (all zero for a server without drafts)."""
    out = {"num_drafts": 0.0, "num_draft_tokens": 0.0, "num_accepted_tokens": 0.0}
    per_pos: dict[int, float] = {}
    for line in metrics_text.splitlines():
        m = _LINE.match(line.strip())
        if not m or not m.group(1).startswith(SPEC_PREFIX):
            continue
        name = m.group(1)[len(SPEC_PREFIX):].removesuffix("_total")
        value = float(m.group(3))
        if name == "num_accepted_tokens_per_pos":
            pos = _POSITION.search(m.group(2) or "")
            if pos:
                per_pos[int(pos.group(1))] = per_pos.get(int(pos.group(1)), 0.0) + value
        elif name in out:
            out[name] += value
    out["accepted_per_pos"] = [per_pos[j] for j in sorted(per_pos)]
    return out


def counter_delta(after: dict, before: dict) -> dict:
    d = {k: after[k] - before[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    n = max(len(after["accepted_per_pos"]), len(before["accepted_per_pos"]))
    pad = lambda xs: xs + [0.0] * (n - len(xs))  # noqa: E731
    d["accepted_per_pos"] = [a - b for a, b in zip(pad(after["accepted_per_pos"]), pad(before["accepted_per_pos"]))]
    return d


def acceptance(delta: dict) -> dict:
    """vLLM's counters over one run -> tau, mean accepted, acceptance rate by draft position."""
    rounds = delta["num_drafts"]
    if rounds <= 0:
        return {"tau": None, "mean_accepted": None, "accept_by_position": [], "rounds": 0}
    return {"tau": 1 + delta["num_accepted_tokens"] / rounds,
            "mean_accepted": delta["num_accepted_tokens"] / rounds,
            "accept_by_position": [x / rounds for x in delta["accepted_per_pos"]],
            "rounds": int(rounds)}


def get(url: str, timeout: float = 10) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def wait_healthy(base: str, alive, timeout_s: float = 900) -> None:
    """Poll `/health` until the server answers; `alive()` False (it died) or timeout -> RuntimeError."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if not alive():
            raise RuntimeError("the server exited while starting")
        try:
            get(base + "/health", timeout=2)
            return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"the server did not answer within {timeout_s:.0f} s")


def stop_server(proc: subprocess.Popen, timeout_s: float = 120) -> None:
    """Terminate a server process and wait for it; kill it when it does not exit in `timeout_s`."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def chat(base: str, model: str, messages: list[dict], max_tokens: int, timeout: float = 3600) -> dict:
    """One greedy chat completion -> {"text", "completion_tokens", "latency_s"}."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "seed": 0}
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as r:
        reply = json.loads(r.read())
    return {"text": reply["choices"][0]["message"]["content"],
            "completion_tokens": int(reply["usage"]["completion_tokens"]),
            "latency_s": time.perf_counter() - t0}


@dataclass
class LoadResult:
    outputs: list[dict]  # per request, in request order
    wall_s: float  # first request sent -> last reply received

    @property
    def tokens(self) -> int:
        return sum(o["completion_tokens"] for o in self.outputs)

    @property
    def tokens_per_s(self) -> float:
        return metrics.tokens_per_s(self.tokens, self.wall_s)


def run_load(base: str, model: str, requests: list[list[dict]], concurrency: int, max_tokens: int) -> LoadResult:
    """All `requests` (chat message lists), at most `concurrency` in flight at any time."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        outputs = list(pool.map(lambda m: chat(base, model, m, max_tokens), requests))
    return LoadResult(outputs, time.perf_counter() - t0)
