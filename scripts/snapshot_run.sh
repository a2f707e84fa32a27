#!/bin/bash
# Copy a training run's latest drafter (in bfloat16: the size to commit) and its metrics.jsonl to a
# fixed folder, so that a lost machine costs at most the progress since:
#
#   scripts/snapshot_run.sh [RUN=runs/base] [DEST=results/base-run]
#
# Resume on a machine that still has RUN/checkpoint with scripts/base_run.sh; without it, start a
# new run from the snapshot's weights with a fresh optimizer (`dflow train --init DEST ...`) and say so.
set -euo pipefail
run=${1:-runs/base-l2}; dest=${2:-results/base-run}
mkdir -p "$dest"
.venv/bin/python - "$run" "$dest" <<'PY'
import sys, torch
from dflow.model import load_drafter, save_drafter
run, dest = sys.argv[1:]
save_drafter(load_drafter(run), dest, dtype=torch.bfloat16)
PY
cp "$run/metrics.jsonl" "$dest/metrics.jsonl"
du -sh "$dest"
