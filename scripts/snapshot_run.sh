#!/bin/bash
# Copy a training run's latest drafter (in bfloat16: the size to commit) and its metrics.jsonl up to
# that drafter's step to a fixed folder, so that a lost machine costs at most the progress since:
#
#   scripts/snapshot_run.sh [RUN=runs/base] [DEST=results/base-run]
#
# Resume on a machine that still has RUN/checkpoint with scripts/base_run.sh; without it, start a
# new run from the snapshot's weights with a fresh optimizer (`dflow train --init DEST ...`) and say so.
set -euo pipefail
run=${1:-runs/base-l2}; dest=${2:-results/base-run}
mkdir -p "$dest"
.venv/bin/python - "$run" "$dest" <<'PY'
import json, sys, torch
from pathlib import Path
from dflow.model import load_drafter, save_drafter
run, dest = map(Path, sys.argv[1:])
save_drafter(load_drafter(run), dest, dtype=torch.bfloat16)
# The metrics end at the drafter's step: steps logged after the last checkpoint are redone on resume.
state = run / "checkpoint" / "train_state.json"
last = json.loads(state.read_text())["step"] if state.exists() else float("inf")
rows = [line for line in (run / "metrics.jsonl").open() if json.loads(line)["step"] <= last]
(dest / "metrics.jsonl").write_text("".join(rows))
PY
du -sh "$dest"
