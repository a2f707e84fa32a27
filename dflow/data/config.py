"""`DataConfig`: every setting of `dflow data`, and which of them decide the data."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dflow.errors import DFlowError
from dflow.targets import DEFAULT_TARGET

ENGINES = ("hf", "vllm")


@dataclass(frozen=True)
class DataConfig:
    target: str = DEFAULT_TARGET
    num_conversations: int = 1000
    max_len: int = 2048
    max_new_tokens: int = 512
    dtype: str = "bfloat16"
    seed: int = 0
    temperature: float = 0.0  # 0 = greedy
    shard_size: int = 64  # conversations per shard: the unit of resumption
    sharegpt: str | None = None  # a ShareGPT-format JSON file; None = the packaged one
    engine: str = "hf"  # what generates the replies: HF `generate` or vLLM's offline `LLM`
    # not part of `settings()`: a resumed run may change these
    batch_size: int = 8  # hf: conversations per generate call; vllm: conversations per request set
    shard: tuple[int, int] | None = None  # (i, n): build only shards k % n == i
    memory_fraction: float | None = None  # vllm: share of memory it insists is free at start
    kv_cache_gib: int | None = 4  # vllm CPU: VLLM_CPU_KVCACHE_SPACE; None: sized from memory_fraction
    cpus: str | None = None  # vllm CPU: the cores its OpenMP threads bind to ("1", "0-1")

    def __post_init__(self):
        for name, low in (("num_conversations", 1), ("max_len", 16), ("max_new_tokens", 1), ("shard_size", 1),
                          ("batch_size", 1), ("kv_cache_gib", 0)):
            if getattr(self, name) is not None and getattr(self, name) < low:
                raise DFlowError(f"--{name.replace('_', '-')} must be at least {low}, got {getattr(self, name)}")
        if self.temperature < 0:
            raise DFlowError(f"--temperature must be >= 0, got {self.temperature}")
        if self.shard is not None and not 0 <= self.shard[0] < self.shard[1]:
            raise DFlowError(f"--shard must be K/N with 0 <= K < N, got {self.shard[0]}/{self.shard[1]}")
        if self.engine not in ENGINES:
            raise DFlowError(f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.memory_fraction is not None and not 0 < self.memory_fraction <= 1:
            raise DFlowError(f"--memory-fraction must be in (0, 1], got {self.memory_fraction}")

    def settings(self) -> dict:
        """What decides the data: a resumed run must repeat these exactly."""
        run_only = ("target", "batch_size", "shard", "memory_fraction", "kv_cache_gib", "cpus")
        return {k: v for k, v in asdict(self).items() if k not in run_only}
