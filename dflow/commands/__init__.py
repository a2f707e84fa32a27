"""The `dflow` subcommands, one module each, and what they share."""

from __future__ import annotations

import re

from dflow.errors import DFlowError


def parse_shard(text: str) -> tuple[int, int]:
    """'K/N' -> (K, N): this process does the K-th of N interleaved shares. DFlowError unless 0 <= K < N."""
    m = re.fullmatch(r"(\d+)/(\d+)", text.strip())
    if not m or not int(m[1]) < int(m[2]):
        raise DFlowError(f"--shard must be K/N with 0 <= K < N (e.g. 0/2), got {text!r}")
    return int(m[1]), int(m[2])
