"""How much of what the target writes a drafter's draft vocabulary can propose: the share of the
tokens of a bench journal's `ar` outputs (`dflow bench ... --out DIR`: DIR/progress.jsonl) that lie
inside the drafter's map (`dflow.vocab`), per dataset. A token outside it is never drafted.

    python scripts/vocab_coverage.py results/base-run --journal results/base-run/bench-gpu23-speed/progress.jsonl
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

from dflow.model import load_drafter


def coverage(d2t: set[int] | None, journal: str, method: str = "ar") -> dict[str, tuple[int, int]]:
    """dataset -> (tokens inside the map, tokens) over `method`'s outputs in the journal."""
    counts = defaultdict(lambda: [0, 0])
    with open(journal) as f:
        for line in f:
            rec = json.loads(line)
            for turn in rec.get("turns", {}).get(method, []):
                ids = turn["token_ids"]
                counts[rec["dataset"]][0] += len(ids) if d2t is None else sum(i in d2t for i in ids)
                counts[rec["dataset"]][1] += len(ids)
    return {k: (a, n) for k, (a, n) in counts.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("drafter")
    ap.add_argument("--journal", required=True, help="a `dflow bench` progress.jsonl with `ar` outputs")
    ap.add_argument("--method", default="ar")
    args = ap.parse_args()
    drafter = load_drafter(args.drafter)
    d2t = None if drafter.dflash.d2t is None else set(drafter.dflash.d2t.tolist())
    size = "the full vocabulary" if d2t is None else f"{len(d2t)} ids"
    rows = coverage(d2t, args.journal, args.method)
    if not rows:
        raise SystemExit(f"error: {args.journal} holds no {args.method} outputs")
    print(f"draft vocabulary of {args.drafter}: {size}")
    for dataset, (inside, total) in rows.items():
        print(f"  {dataset}: {inside / total:.1%} of {total} {args.method} tokens inside")


if __name__ == "__main__":
    main()
