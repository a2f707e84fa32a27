"""The `dflow` subcommands, one module each, and what they share."""

from __future__ import annotations

import argparse
import re

from dflow.errors import DFlowError
from dflow.targets import DEVICES


def parse_shard(text: str) -> tuple[int, int]:
    """'K/N' -> (K, N): this process does the K-th of N interleaved shares. DFlowError unless 0 <= K < N."""
    m = re.fullmatch(r"(\d+)/(\d+)", text.strip())
    if not m or not int(m[1]) < int(m[2]):
        raise DFlowError(f"--shard must be K/N with 0 <= K < N (e.g. 0/2), got {text!r}")
    return int(m[1]), int(m[2])


def add_device_arg(p: argparse.ArgumentParser, what: str = "decoding") -> None:
    """--device auto|cpu|cuda (resolved by `dflow.targets.resolve_device`)."""
    p.add_argument("--device", default="auto", choices=DEVICES,
                   help=f"where {what} runs (auto: CUDA when present, else the CPU)")
