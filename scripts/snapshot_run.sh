#!/bin/bash
# Copy a training run's latest drafter (in bfloat16: the size to commit), its checkpoint's step and settings
# (train_state.json, without the optimizer's moments) and its metrics.jsonl up to that step to a fixed
# folder, so that a lost machine costs at most the progress since (dflow.train.checkpoint.write_snapshot):
#
#   scripts/snapshot_run.sh [RUN=runs/base-l2] [DEST=results/base-run]
#
# Resume on a machine that still has RUN/checkpoint with scripts/base_run.sh (--resume); without it, the same
# run goes on from the snapshot in a new folder with a fresh optimizer: `dflow train` with the run's flags and
# `--resume-from DEST` (scripts/base_run.sh: SNAPSHOT=DEST), which says so in the log.
set -euo pipefail
run=${1:-runs/base-l2}; dest=${2:-results/base-run}
.venv/bin/python - "$run" "$dest" <<'PY'
import sys
from pathlib import Path
from dflow.errors import DFlowError
from dflow.train.checkpoint import write_snapshot
try:
    step = write_snapshot(Path(sys.argv[1]), Path(sys.argv[2]))
except DFlowError as e:
    sys.exit(f"snapshot_run.sh: {e}")
print(f"{sys.argv[2]}: {sys.argv[1]}'s drafter" + (f" at step {step}" if step is not None else " (no checkpoint: no step)"))
PY
du -sh "$dest"
