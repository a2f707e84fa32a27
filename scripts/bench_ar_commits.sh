#!/bin/bash
# `ar` decode tokens/s of two commits, alternating processes on one core (a change's speed check):
#
#   scripts/bench_ar_commits.sh OLD_COMMIT [NEW_COMMIT=HEAD] [PAIRS=3] [TOKENS=96]   (env: CORE, PYTHON)
#
# Each commit is exported with `git archive` and run as `dflow generate --method ar --dtype bfloat16
# --json` with its own code first on PYTHONPATH; old and new alternate PAIRS times, and the script
# prints each run's tokens/s and the best of each side.
set -euo pipefail
old=$1; new=${2:-HEAD}; pairs=${3:-3}; tokens=${4:-96}
py=${PYTHON:-$PWD/.venv/bin/python}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for c in "$old" "$new"; do mkdir -p "$tmp/$c"; git archive "$c" dflow | tar -x -C "$tmp/$c"; done
prompt="Write a short story about a lighthouse keeper."
run() {
  PYTHONPATH="$tmp/$1" OMP_NUM_THREADS=1 taskset -c "${CORE:-0}" "$py" -c "import sys; from dflow.cli import main; sys.exit(main())" \
    generate --method ar --dtype bfloat16 --max-new-tokens "$tokens" --json "$prompt" 2>/dev/null |
    "$py" -c "import json, sys; r = json.loads(sys.stdin.read()); print(r.get('tokens_per_s') or r['stats']['tokens_per_s'])"
}
best_old=0; best_new=0
for i in $(seq "$pairs"); do
  o=$(run "$old"); n=$(run "$new")
  echo "pair $i: $old $o tok/s, $new $n tok/s"
  best_old=$(echo "$o $best_old" | awk '{print ($1 > $2) ? $1 : $2}')
  best_new=$(echo "$n $best_new" | awk '{print ($1 > $2) ? $1 : $2}')
done
echo "best: $old $best_old, $new $best_new tok/s; new / old = $(echo "$best_new $best_old" | awk '{printf "%.3f", $1 / $2}')"
