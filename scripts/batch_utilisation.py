"""How much of `dflow data`'s batched decoding does useful work, replayed from a data folder's shards.

Each shard is regenerated as `HFRegenerator.run_shard` does: a FIFO queue of its conversations, up to
--batch-size of them answering one turn per HF `generate` call, which runs until its longest reply
ends. A call's useful work is the sum of its reply lengths; its cost is batch_size x the longest.

    python scripts/batch_utilisation.py data/smollm2-135m-sharegpt-3000 --batch-size 16
"""

from __future__ import annotations

import argparse
from collections import deque
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file


def reply_lengths(mask: np.ndarray) -> list[int]:
    """Lengths of the runs of True in a loss mask: the target's replies, in order."""
    edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    return (np.flatnonzero(edges == -1) - np.flatnonzero(edges == 1)).tolist()


def replay(conversations: list[list[int]], batch_size: int) -> tuple[int, int, int, int]:
    """-> (reply tokens, decode slots, generate calls, rows over all calls) for one shard."""
    turns = [deque(r) for r in conversations]
    queue = deque(i for i, t in enumerate(turns) if t)
    used = slots = calls = rows = 0
    while queue:
        batch = [queue.popleft() for _ in range(min(batch_size, len(queue)))]
        lengths = [turns[i].popleft() for i in batch]
        used, slots = used + sum(lengths), slots + batch_size * max(lengths)
        calls, rows = calls + 1, rows + len(batch)
        queue.extend(i for i in batch if turns[i])
    return used, slots, calls, rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder")
    p.add_argument("--batch-size", type=int, default=16)
    args = p.parse_args()
    totals = np.zeros(4, dtype=np.int64)
    for path in sorted(Path(args.folder).glob("shard-*.safetensors")):
        shard = load_file(str(path))
        mask = np.unpackbits(shard["loss_mask"], count=len(shard["input_ids"])).astype(bool)
        offsets = shard["offsets"]
        convs = [reply_lengths(mask[a:b]) for a, b in zip(offsets[:-1], offsets[1:])]
        totals += replay(convs, args.batch_size)
    used, slots, calls, rows = totals
    print(f"{args.folder}: {calls} generate calls, {rows / calls:.1f} of {args.batch_size} rows per call, "
          f"{used / slots:.0%} of decode slots hold a reply token")


if __name__ == "__main__":
    main()
