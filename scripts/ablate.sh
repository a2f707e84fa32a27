#!/bin/bash
# One k = 0 training ablation of issue 18 and its held-out yardstick, on one core:
#
#   scripts/ablate.sh NAME [dflow train flags...]      (env: DATA, CORE, THREADS, EVAL_TOKENS, OUT)
#
# trains `dflow train --rounds 0` with the new recipe's cost levers (bf16 target and autocast,
# compiled layers) over the BASELINE below, plus the given flags into $OUT/NAME (default runs/abl), holding out the data's
# last 24 conversations, then scores the drafter teacher-forced on them at block indices 1..4
# (scripts/probe_index1.py --probes drafter). `/usr/bin/time` in NAME.log gives its core-seconds;
# scripts/ablation_table.py collects the runs into one table.
set -euo pipefail
# The series' baseline, which every row's flags modify: DFlash's settings, `dflow train`'s defaults
# when the series began (5 layers fusing 5, gamma 7, no anchor bias, the full vocabulary, lr 6e-4,
# 4 sequences x 32 anchors); the flags after NAME override them.
SHAPE=(--layers 5 --target-layers 5 --draft-vocab full)  # a fresh drafter's; --init brings its own
BASELINE=(--loss-gamma dflash --block-bias 0 --lr 6e-4 --batch-size 4 --anchors-per-seq 32 --loss ce)
[[ " $* " == *" --init "* ]] || BASELINE=("${SHAPE[@]}" "${BASELINE[@]}")
name=$1; shift
data=${DATA:-runs/ablate-data}
# The series' data: the first 69 shards (4,416 conversations) of the 6,400 set, as the build had
# them when the series began; made again here (links and a meta.json) on a machine without it.
if [ -z "${DATA:-}" ] && [ ! -f "$data/meta.json" ]; then
  "${PYTHON:-.venv/bin/python}" - "$data" <<'PY'
import os, sys
from pathlib import Path
from dflow.data.shards import read_meta, write_meta
src, dst = Path("data/smollm2-135m-sharegpt-6400"), Path(sys.argv[1])
meta = read_meta(src)
meta.update(shards=meta["shards"][:69], complete=False)
dst.mkdir(parents=True, exist_ok=True)
for name in meta["shards"]:
    if not (dst / name).exists():
        os.symlink((src / name).resolve(), dst / name)
write_meta(dst, meta)
PY
fi
root=${OUT:-runs/abl}
out=$root/$name
py=${PYTHON:-.venv/bin/python}
mkdir -p "$root"
export OMP_NUM_THREADS=${THREADS:-1}
cores=${CORE:-0}
{ /usr/bin/time -v taskset -c "$cores" "$py" -m dflow.cli train --data "$data" --out "$out" --rounds 0 \
    --dtype bfloat16 --bf16 --compile --max-len 1536 --eval-samples 24 --eval-tokens "${EVAL_TOKENS:-1}" \
    --save-every 50 --no-progress "${BASELINE[@]}" "$@"
  taskset -c "$cores" "$py" scripts/probe_index1.py --data "$data" --probes drafter --drafter "$out" \
    --held-out 24 --json "$root/$name.probe.json"
  echo DONE; } > "$root/$name.log" 2>&1
