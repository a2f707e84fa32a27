#!/bin/bash
# Train on one GPU for a fixed wall-clock budget, with the learning-rate schedule ending on time:
# a short calibration run (--stop-at CAL, inside the warmup, so no step so far depends on the run's
# length) measures the step time, then the run resumes with the --max-steps that fill the budget,
# and its cosine decays to 0 at the budget's end. For a leased GPU whose minutes are counted.
#
#   OUT=runs/gpu DATA=data/smollm2-135m-sharegpt-16k INIT=results/base-run BUDGET=420 scripts/gpu_train.sh [FLAGS...]
#       env: OUT, DATA, INIT (a drafter to start from; none: a fresh one), BUDGET (seconds from this
#       script's start to the end of training, the final evaluation included; default 3600), CAL
#       (calibration steps; default 20), BATCH (sequences per step; default 32), LR (default 6e-4),
#       WARMUP (steps, > CAL; default 40), SEED, ROUNDS (default 0: DFlash), RESERVE (seconds kept for
#       the final save and held-out evaluation; default 60), PY (python; default python3), DEVICE (default
#       cuda; cpu for a dry run), STEPS (no calibration: the run's --max-steps, e.g. a branch of another's
#       length; BUDGET is then unused);
#       FLAGS go to `dflow train` as they are (both runs).
# The run folder is an ordinary one: `dflow train --resume --out OUT ...` continues it. Exit 3: the
# calibration took over a third of the budget (its step times are printed; nothing more is spent).
set -euo pipefail
out=${OUT:?OUT=run folder} data=${DATA:?DATA=a dflow data folder}
budget=${BUDGET:-3600} cal=${CAL:-20} warmup=${WARMUP:-40} py=${PY:-python3} reserve=${RESERVE:-60}
[ "$warmup" -gt "$cal" ] || { echo "gpu_train.sh: WARMUP ($warmup) must exceed CAL ($cal)" >&2; exit 2; }
[ -e "$out/checkpoint" ] && { echo "gpu_train.sh: $out already holds a checkpoint; resume it with dflow train --resume" >&2; exit 2; }
start=(--block-bias 0)
[ -n "${INIT:-}" ] && start+=(--init "$INIT")
t0=$(date +%s.%N)
args=(-m dflow.train --device "${DEVICE:-cuda}" --data "$data" --out "$out" --rounds "${ROUNDS:-0}" --dtype bfloat16
      --bf16 --layers 2 --target-layers 5 --batch-size "${BATCH:-32}" --anchors-per-seq 128 --lr "${LR:-6e-4}"
      --warmup "$warmup" --loss-gamma 1 "${start[@]}" --max-len 1536 --save-every 100 --eval-every 0
      --eval-samples 24 --eval-tokens 64 --seed "${SEED:-0}" --no-progress "$@")
if [ -n "${STEPS:-}" ]; then
    exec "$py" "${args[@]}" --max-steps "$STEPS"
fi
# The calibration may take a third of the budget: a pathological step time (a GPU session once saw
# 38 s a step, from cuDNN attention plans) is reported with what was measured, not paid in full.
if ! timeout "$(( ${budget%.*} / 3 ))" "$py" "${args[@]}" --max-steps 1000000 --stop-at "$cal"; then
    echo "gpu_train.sh: the $cal calibration steps did not finish in a third of the budget; step seconds so far:" \
        "$("$py" -c 'import json,sys; print([round(r["tokens"] / r["tokens_per_s"], 2) for r in map(json.loads, open(sys.argv[1])) if "tokens_per_s" in r])' "$out/metrics.jsonl" 2>/dev/null)" >&2
    exit 3
fi
steps=$("$py" - "$out/metrics.jsonl" "$t0" "$budget" "$cal" "$reserve" <<'EOF'
import json, statistics, sys, time
path, t0, budget, cal, reserve = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
recs = [json.loads(line) for line in open(path)]
secs = [r["tokens"] / r["tokens_per_s"] for r in recs if "tokens_per_s" in r]
per_step = statistics.median(secs[len(secs) // 4:]) * 1.05  # past the first (warm-up) steps; 5% for logging
startup = (time.time() - t0) - sum(secs)  # loading, saving: paid again by the resumed run
left = budget - (time.time() - t0) - startup - reserve
steps = cal + max(0, int(left / per_step))
print(f"gpu_train.sh: {per_step:.3f} s/step, startup {startup:.0f} s, {left:.0f} s left: --max-steps {steps}",
      file=sys.stderr)
print(steps)
EOF
)
"$py" "${args[@]}" --max-steps "$steps" --resume
