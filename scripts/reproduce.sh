#!/usr/bin/env bash
# The CPU-scale reproduction of the paper's Tables 1 and 3 (docs/results.md), step by step.
# Every step resumes where it stopped: rerun the script after an interruption.
#
#   scripts/reproduce.sh [STAGE...]     stages: base branches bench audit tables (default: all);
#                                       bench is bench_t0 then bench_t1; more_data (not in the default)
#                                       is the data-size check of docs/results.md
#
# Settings are the ones docs/results.md reports; change them here, for all runs alike.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
DFLOW="${DFLOW:-.venv/bin/dflow}"

DATA=data/smollm2-135m-sharegpt-256  # 224 conversations (218 train + 6 held out)
COMMON=(--target smollm2-135m --batch-size 4 --anchors-per-seq 32 --max-len 1024
        --dtype bfloat16 --bf16 --lr 6e-4 --save-every 10 --eval-samples 6 --eval-tokens 64 --no-progress
        --loss-gamma dflash --block-bias 0 --draft-vocab full)  # the settings of the time (since: the new defaults)
BASE_EPOCHS=8     # shared DFlash stage (k = 0)
BRANCH_EPOCHS=1   # then each run continues from it with its own objective
CORES=$(nproc)
TRAIN=("$DFLOW" train)  # a stage may set a local TRAIN (torchrun for DDP)

train() {  # train OUT ARGS...: start, or resume when OUT has a checkpoint
  local out=$1; shift
  if [[ -f $out/model.safetensors && ! -d $out/checkpoint ]] || [[ -f $out/.done ]]; then return; fi
  local resume=(); [[ -d $out/checkpoint ]] && resume=(--resume)
  "${PIN[@]}" "${TRAIN[@]}" "${COMMON[@]}" --out "$out" "$@" "${resume[@]}"
  touch "$out/.done"
}

BENCH=(--methods ar,pld
       --variant dflash=dflash@runs/a --variant dflash-sc=dflash@runs/b
       --variant dflow-relay-off=dflash@runs/c --variant dflow=dflow@runs/c
       --max-new-tokens 256 --dtype bfloat16 --runtime-breakdown)
NUM_PROMPTS="${NUM_PROMPTS:-40}"

bench() {  # bench OUT ARGS...: start, or resume the journaled run (the prompt count may grow)
  local out=$1; shift
  local resume=(); [[ -f $out/progress.jsonl ]] && resume=(--resume)
  "${PIN[@]}" "$DFLOW" bench "$@" --out "$out" "${resume[@]}"
}

PIN=()
on_core() {  # on_core N FUNCTION ARGS...: one thread pinned to core N when the machine has a second core
  if (( CORES > 1 )); then local PIN=(taskset -c "$1"); OMP_NUM_THREADS=1 "${@:2}"; else "${@:2}"; fi
}

split_bench() {  # split_bench OUT ARGS...: even prompts on core 0, odd ones on core 1 (--shard), each share
  local out=$1; shift  # journaled in runs/ (starting from what OUT already holds), then merged into OUT
  local share=runs/$(basename "$out") from=(); [[ -f $out/progress.jsonl ]] && from=(--merge "$out")
  on_core 0 bench "$share-s0" "$@" --shard 0/2 "${from[@]}" & local p0=$!
  on_core 1 bench "$share-s1" "$@" --shard 1/2 "${from[@]}" & local p1=$!
  wait $p0; wait $p1
  OMP_NUM_THREADS=1 bench "$out" "$@" --merge "$share-s0" --merge "$share-s1"  # the shares' thread count, reported
}

stage_base() { train runs/base --data "$DATA" --layers 2 --rounds 0 --epochs $BASE_EPOCHS --warmup 20; }
stage_branches() {  # (c) on core 0 while (a) then (b) run on core 1
  B=(--data "$DATA" --init runs/base --epochs $BRANCH_EPOCHS --warmup 5)
  on_core 0 train runs/c "${B[@]}" --rounds 2 & local p0=$!                             # DFlow
  { on_core 1 train runs/a "${B[@]}" --rounds 0                                          # DFlash
    on_core 1 train runs/b "${B[@]}" --rounds 2 --no-relay; } & local p1=$!              # + self-conditioning
  wait $p0; wait $p1
}
stage_bench() { stage_bench_t0; stage_bench_t1; }
stage_bench_t0() { split_bench results/bench-t0 "${BENCH[@]}" --num-prompts "$NUM_PROMPTS"; }
stage_bench_t1() {
  split_bench results/bench-t1 "${BENCH[@]}" --num-prompts "${NUM_PROMPTS_T1:-$NUM_PROMPTS}" --temperature 1 --seed 0
}
stage_audit() {
  split_bench results/audit-fp32 --methods ar --variant dflash=dflash@runs/a --variant dflow=dflow@runs/c \
    --num-prompts 10 --max-new-tokens 64 --dtype float32
}
stage_more_data() {  # base's recipe and compute (432 steps x 4 sequences) on 768 conversations, not 218;
  # needs the 3,000 build at exactly its first 24 shards: git checkout cd2466e -- data/smollm2-135m-sharegpt-3000
  local TRAIN=(.venv/bin/torchrun --standalone --nproc_per_node 2 -m dflow.train)  # DDP: 2 processes x 2 sequences
  OMP_NUM_THREADS=1 train runs/base768 --batch-size 2 --data data/smollm2-135m-sharegpt-3000 --layers 2 --rounds 0 \
    --max-steps 432 --warmup 20
  split_bench results/more-data --methods ar --variant base-218=dflash@runs/base \
    --variant base-768=dflash@runs/base768 --num-prompts 10 --max-new-tokens 128 --dtype bfloat16
}
stage_tables() {  # the bench tables into docs/results.md; the training table (Training section) printed
  .venv/bin/python scripts/results_tables.py --t0 results/bench-t0 --t1 results/bench-t1 \
    --fp32 results/audit-fp32 --into docs/results.md
  .venv/bin/python scripts/results_tables.py --t0 results/bench-t0 \
    --train base=runs/base dflash=runs/a dflash-sc=runs/b dflow=runs/c | sed -n '/^## Training cost/,$p'
}

for stage in "${@:-base branches bench audit tables}"; do
  for s in $stage; do "stage_$s"; done
done
