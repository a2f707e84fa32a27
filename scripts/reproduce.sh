#!/usr/bin/env bash
# The CPU-scale reproduction of the paper's Tables 1 and 3 (docs/results.md), step by step.
# Every step resumes where it stopped: rerun the script after an interruption.
#
#   scripts/reproduce.sh [STAGE...]     stages: base branches bench audit tables (default: all)
#
# Settings are the ones docs/results.md reports; change them here, for all runs alike.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
DFLOW="${DFLOW:-.venv/bin/dflow}"

DATA=data/smollm2-135m-sharegpt-256
COMMON=(--target smollm2-135m --data "$DATA" --batch-size 4 --anchors-per-seq 32 --max-len 1024
        --dtype bfloat16 --bf16 --lr 6e-4 --save-every 10 --eval-samples 6 --eval-tokens 64 --no-progress)
BASE_EPOCHS=8     # shared DFlash stage (k = 0)
BRANCH_EPOCHS=1   # then each run continues from it with its own objective

train() {  # train OUT ARGS...: start, or resume when OUT has a checkpoint
  local out=$1; shift
  if [[ -f $out/model.safetensors && ! -d $out/checkpoint ]] || [[ -f $out/.done ]]; then return; fi
  local resume=(); [[ -d $out/checkpoint ]] && resume=(--resume)
  "$DFLOW" train "${COMMON[@]}" --out "$out" "$@" "${resume[@]}"
  touch "$out/.done"
}

BENCH=(--datasets humaneval,gsm8k,mt-bench --methods ar,pld
       --variant dflash=dflash@runs/a --variant dflash-sc=dflash@runs/b
       --variant dflow-relay-off=dflash@runs/c --variant dflow=dflow@runs/c
       --max-new-tokens 256 --dtype bfloat16 --runtime-breakdown)
NUM_PROMPTS="${NUM_PROMPTS:-40}"

bench() {  # bench OUT ARGS...: start, or resume the journaled run (the prompt count may grow)
  local out=$1; shift
  local resume=(); [[ -f $out/progress.jsonl ]] && resume=(--resume)
  "$DFLOW" bench "$@" --out "$out" "${resume[@]}"
}

stage_base() { train runs/base --layers 2 --rounds 0 --epochs $BASE_EPOCHS --warmup 20; }
stage_branches() {
  train runs/c --init runs/base --rounds 2 --epochs $BRANCH_EPOCHS --warmup 5             # DFlow
  train runs/a --init runs/base --rounds 0 --epochs $BRANCH_EPOCHS --warmup 5             # DFlash
  train runs/b --init runs/base --rounds 2 --no-relay --epochs $BRANCH_EPOCHS --warmup 5  # + self-conditioning
}
stage_bench() {
  bench results/bench-t0 "${BENCH[@]}" --num-prompts "$NUM_PROMPTS"
  bench results/bench-t1 "${BENCH[@]}" --num-prompts "$NUM_PROMPTS" --temperature 1 --seed 0
}
stage_audit() {
  bench results/audit-fp32 --datasets humaneval,gsm8k,mt-bench --methods ar --variant dflash=dflash@runs/a \
    --variant dflow=dflow@runs/c --num-prompts 10 --max-new-tokens 64 --dtype float32
}
stage_tables() {
  .venv/bin/python scripts/results_tables.py --t0 results/bench-t0 --t1 results/bench-t1 \
    --fp32 results/audit-fp32 --train base=runs/base dflash=runs/a dflash-sc=runs/b dflow=runs/c
}

for stage in "${@:-base branches bench audit tables}"; do
  for s in $stage; do "stage_$s"; done
done
