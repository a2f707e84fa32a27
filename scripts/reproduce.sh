#!/usr/bin/env bash
# Issue 14's reproduction of the paper's Tables 1 and 3 on this CPU (docs/results.md), step by step:
# the long DFlash base run, three branches of equal steps from it, the depth/block-size timing, the
# decode benches (T = 0 and T = 1), the float32 lossless audit, the vLLM serving bench and the tables.
# Every stage resumes where it stopped (training from its checkpoint, benches from their journals):
# rerun the script after an interruption. The reproduction before the 16K data set and the issue-18
# recipe (218 training conversations) is `git show 716b11e:scripts/reproduce.sh`.
#
#   scripts/reproduce.sh [STAGE...]   stages: base base2j features base2k branches depth blocks bench audit serve tables
#                                     (default: all but features and base2k, which are under way: the branches and
#                                     benches read 2j2's drafter until 2k3 ends); bench is bench_t0 then bench_t1
#
# Training runs through scripts/base_run.sh (the recipe: docs/training.md), DDP over both cores (stage 2j: BASE2J_CORES).
set -euo pipefail
cd "$(dirname "$0")/.."
DFLOW="${DFLOW:-.venv/bin/dflow}"
D6400=data/smollm2-135m-sharegpt-6400
D16K=data/smollm2-135m-sharegpt-16k
# The base stage's last sub-stage: the branches start from its drafter. It ran on a leased GPU; on a
# machine without CUDA set BASE=results/base-run (its committed drafter, bf16) and skip `base`.
BASE="${BASE:-runs/gpu-s23}"
# The decode benches' dtype: bf16, except on a CPU without native bf16 matmuls (AVX2 only), where it
# runs about 80x slower than float32 (dflow.targets.fast_bf16) and the benches (and branches) take float32.
BENCH_DTYPE="${BENCH_DTYPE:-$(.venv/bin/python -c 'import torch; from dflow.targets import fast_bf16; print("bfloat16" if fast_bf16(torch.device("cpu")) else "float32")')}"
BRANCH_STEPS="${BRANCH_STEPS:-300}"  # each branch, same data order (SEED), same steps

stage_done() {  # stage_done OUT STEP: OUT's checkpoint is at STEP or later
  [[ -f $1/checkpoint/train_state.json ]] &&
    (( $(.venv/bin/python -c 'import json,sys; print(json.load(open(sys.argv[1]))["step"])' \
         "$1/checkpoint/train_state.json") >= $2 ))
}
run() {  # run OUT STOP [VAR=VALUE...] [-- FLAGS...]: scripts/base_run.sh until OUT's checkpoint is at STOP
  local out=$1 stop=$2; shift 2
  local env=() flags=(); while (( $# )) && [[ $1 != -- ]]; do env+=("$1"); shift; done; (( $# )) && shift; flags=("$@")
  stage_done "$out" "$stop" && return
  mkdir -p runs; echo "=== $(date -u +%FT%TZ) scripts/reproduce.sh: $out to step $stop (${env[*]} ${flags[*]})" >> "$out.log"
  env OUT="$out" STOP="$stop" "${env[@]}" scripts/base_run.sh "${flags[@]}" >> "$out.log" 2>&1
}
snapshot() {  # snapshot RUN DEST: RUN's drafter in bf16, what the next sub-stage starts from (as it did)
  [[ -f $2/model.safetensors ]] || scripts/snapshot_run.sh "$1" "$2" > /dev/null
}

# The base stage as it ran (docs/training.md, "The long run"): eight sub-stages, each but the first
# from the last one's drafter with a fresh optimizer and schedule. 2b-2e restarted from the
# committed bf16 snapshot after the machine was lost; 2c's schedule was shortened at step 600 to
# end at 20 core-hours over all sub-stages, and set at step 1000 from the measured step cost; 2c
# ended at step 1,500 when the machine was lost; 2d ran in float32 (an AVX2 machine, no native bf16
# matmuls) to step 200 when the machine was lost again; 2e (bf16 again, AVX-512) set its total from
# 2,100 to 2,600 steps at step 100, from the measured step cost, and to 2,800 at step 900 (to end
# near 20 core-hours over all sub-stages). 2f, 2g and 2h are warm restarts from the last drafter at
# lower peaks, 3,000 steps (about 8 core-hours) each, whose annealed ends test the curve's flatness;
# 2i, the same again, was overtaken at its step 1,800 by a GPU stage from its snapshot.
stage_base() {
  run runs/base-l2 1800 DATA=$D6400 STEPS=18000
  run runs/base-l2-16k 400 DATA=$D16K INIT=runs/base-l2 STEPS=16200
  snapshot runs/base-l2-16k runs/base-l2-16k-snapshot
  run runs/base-l2-16k2 600 DATA=$D16K INIT=runs/base-l2-16k-snapshot STEPS=15800
  snapshot runs/base-l2-16k2 runs/base-l2-16k2-snapshot
  run runs/base-l2-16k3 600 DATA=$D16K INIT=runs/base-l2-16k2-snapshot STEPS=15200 SEED=1
  run runs/base-l2-16k3 1000 DATA=$D16K INIT=runs/base-l2-16k2-snapshot STEPS=3750 SEED=1
  run runs/base-l2-16k3 1500 DATA=$D16K INIT=runs/base-l2-16k2-snapshot STEPS=4100 SEED=1
  snapshot runs/base-l2-16k3 runs/base-l2-16k3-snapshot
  run runs/base-l2-16k4 200 DATA=$D16K INIT=runs/base-l2-16k3-snapshot STEPS=2600 SEED=2 WARMUP=30 LR=9e-4 \
    DTYPE=float32 AUTOCAST=--no-bf16
  snapshot runs/base-l2-16k4 runs/base-l2-16k4-snapshot
  run runs/base-l2-16k5 100 DATA=$D16K INIT=runs/base-l2-16k4-snapshot STEPS=2100 SEED=3 WARMUP=30 LR=8e-4
  run runs/base-l2-16k5 900 DATA=$D16K INIT=runs/base-l2-16k4-snapshot STEPS=2600 SEED=3 WARMUP=30 LR=8e-4
  run runs/base-l2-16k5 2800 DATA=$D16K INIT=runs/base-l2-16k4-snapshot STEPS=2800 SEED=3 WARMUP=30 LR=8e-4
  snapshot runs/base-l2-16k5 runs/base-l2-16k5-snapshot
  run runs/base-l2-16k6 3000 DATA=$D16K INIT=runs/base-l2-16k5-snapshot STEPS=3000 SEED=4 WARMUP=30 LR=6e-4
  snapshot runs/base-l2-16k6 runs/base-l2-16k6-snapshot
  run runs/base-l2-16k7 3000 DATA=$D16K INIT=runs/base-l2-16k6-snapshot STEPS=3000 SEED=5 WARMUP=30 LR=4e-4
  snapshot runs/base-l2-16k7 runs/base-l2-16k7-snapshot
  run runs/base-l2-16k8 3000 DATA=$D16K INIT=runs/base-l2-16k7-snapshot STEPS=3000 SEED=6 WARMUP=30 LR=4e-4
  snapshot runs/base-l2-16k8 runs/base-l2-16k8-snapshot
  run runs/base-l2-16k9 1800 DATA=$D16K INIT=runs/base-l2-16k8-snapshot STEPS=3000 SEED=9 WARMUP=30 LR=4e-4
  snapshot runs/base-l2-16k9 runs/base-l2-16k9-snapshot
  # Session 23's H200 stage from 2i's step 1,800: scripts/gpu_train.sh's flags, the 1,291 steps its
  # budget fitted (its calibration stops inside the warmup, so one uninterrupted run is the same run).
  if [[ ! -f $BASE/checkpoint/train_state.json ]] || ! stage_done "$BASE" 1291; then
    .venv/bin/python -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' \
      || { echo "reproduce.sh: the GPU stage needs CUDA (BASE=results/base-run skips it)" >&2; exit 1; }
    local resume=(); [[ -d $BASE/checkpoint ]] && resume=(--resume)
    .venv/bin/python -m dflow.train --device cuda --data $D16K --out "$BASE" --rounds 0 --dtype bfloat16 --bf16 \
      --layers 2 --target-layers 5 --batch-size 32 --anchors-per-seq 128 --lr 6e-4 --warmup 40 --loss-gamma 1 \
      --block-bias 0 --init runs/base-l2-16k9-snapshot --max-len 1536 --save-every 100 --eval-every 0 \
      --eval-samples 24 --eval-tokens 64 --seed 8 --no-progress --max-steps 1291 "${resume[@]}" >> "$BASE.log" 2>&1
  fi
}
# Stage 2j, from session 26 on this CPU: the GPU stage's recipe (32 sequences a step: 2 a micro-step
# x 16 micro-steps, shared by the processes, one per core of BASE2J_CORES; peak 6e-4) from its
# drafter, a fresh cosine of 1,300 steps (2j2: its last BASE2J_STEPS), over several sessions (each stops after a
# checkpoint: every 10 steps, 3-8 minutes). BASE2J_CORES=0 (one process: the other core stays free
# for benches and tests) or 0,1 (DDP, twice the rate); a resume may change it, the global batch
# stays 32 (dflow train checks it). On a machine without CUDA: BASE=results/base-run
# scripts/reproduce.sh base2j; BASE2J_STOP=N ends a session's share at step N's checkpoint.
BASE2J="${BASE2J:-runs/base-2j2}"
BASE2J_STEPS="${BASE2J_STEPS:-900}"
BASE2J_CORES="${BASE2J_CORES:-${BASE2J_CORE:-0}}"
ddp_split() {  # ddp_split CORES: the env and flags of a 32-sequence step shared by one process per core of CORES
  local nproc; nproc=$(tr ',' '\n' <<< "$1" | grep -c .)
  (( 16 % nproc == 0 )) || { echo "reproduce.sh: BASE2J_CORES/BASE2K_CORES must name 1, 2, 4, 8 or 16 cores" >&2; exit 1; }
  SPLIT=(NPROC=$nproc CORES="$1" -- --grad-accum $((16 / nproc)) --save-every 10 --eval-every 100)
}
stage_base2j() {
  ddp_split "$BASE2J_CORES"
  # 2j ran to step 400 in runs/base-2j (sessions 26-27), whose folder was lost with its machine; its
  # step-400 snapshot, committed in results/base-2j, stands for it (as results/base-run does for the base)
  [[ -f results/base-2j/model.safetensors ]] || run runs/base-2j 400 DATA=$D16K INIT=$BASE STEPS=1300 SEED=11 \
    WARMUP=40 LR=6e-4 "${SPLIT[@]}"
  snapshot runs/base-2j results/base-2j
  # 2j2 (session 28 on): the rest of 2j's cosine (900 steps from its step-400 rate, 4.87e-4) as a fresh one
  # from that snapshot, with a fresh optimizer (warmup 10) and a new data order; its latest drafter is
  # committed in results/base-2j2 (scripts/snapshot_run.sh runs/base-2j2 results/base-2j2)
  run $BASE2J "${BASE2J_STOP:-$BASE2J_STEPS}" DATA=$D16K INIT=results/base-2j STEPS=$BASE2J_STEPS SEED=12 WARMUP=10 \
    LR=4.87e-4 "${SPLIT[@]}"
}
# Stage 2k (session 37 on): the next doubling of the base's blocks (issue 14's stopping rule reads the held-out
# curve over it), a fresh cosine of 1,300 steps (about 5M blocks, 28 EPYC core-hours) from 2j2's final drafter, a
# fresh optimizer, a new data order and a lower peak, 3e-4: 2j2's held-out readings stayed level while its rate was
# above about 2e-4 and rose as it decayed (docs/training.md). 2k ran to step 245 in runs/base-2k (sessions 37-38),
# whose folder was lost with its machine; its step-245 snapshot, committed in results/base-2k, stands for it.
# 2k2 (session 39): the rest of 2k's cosine (1,055 steps from its step-245 rate, 2.76e-4) as a fresh one from
# that snapshot, with a fresh optimizer (warmup 10) and a new data order, as 2j2 went on from 2j; it ran to step
# 281 and its folder was lost too: its step-281 snapshot, committed in results/base-2k2, stands for it.
# 2k3 (session 40 on): the rest of 2k2's compute from its step-281 drafter (fresh optimizer, warmup 10, new data
# order, peak 2.33e-4: 2k2's rate there), trained in blocks of 4, the block the shipped drafter decodes in: with the
# loss decay gamma 1, block indices 1-3 carry 95% of the loss weight, and a step in blocks of 4 costs about a third
# of one in 16 on a bf16 CPU (docs/training.md, "Stage 2k3"), so 2,100 steps are about 2k2's remaining 774 steps
# of compute. Its latest drafter and step are committed in results/base-2k3 every session (scripts/snapshot_run.sh
# runs/base-2k3 results/base-2k3); a lost runs/base-2k3 goes on from that snapshot as the same run (its step,
# schedule and data order; a fresh optimizer: `dflow train --resume-from`, SNAPSHOT in scripts/base_run.sh).
# BASE2K_STOP=N ends a session's share at step N's checkpoint; BASE2K_CORES as BASE2J_CORES; on a CPU without
# native bf16 matmuls scripts/base_run.sh trains in float32 (a resume may change the dtype with the machine).
BASE2K="${BASE2K:-runs/base-2k3}"
BASE2K_STEPS="${BASE2K_STEPS:-2100}"
BASE2K_CORES="${BASE2K_CORES:-0,1}"
# 2k3's float8 feature cache (session 43 on). The target's context forward is most of a k = 0 step in blocks of 4
# on the CPUs measured so far: about three quarters in float32 on an AVX2 EPYC, and in bf16 on an AVX-512 EPYC
# (scripts/probe_feature_cache_step.sh: 26.1 CPU-s live against 6.0 cached over 8 steps there). One target pass over
# the data, in the run's dtype (BENCH_DTYPE: float32 where bf16 matmuls are not native), stores it (the 5 fused
# layers in float8 e4m3 with a float32 scale per token and layer: 33 GB for the 11.4M tokens, where bfloat16 would
# need 65) and 2k3 reads it from then on (--feature-cache), once every data shard has its cache shard.
# docs/training.md, "A float8 feature cache". One process per core of BASE2K_CORES; an interrupted build resumes at
# its first missing shard. A float32 cache and a bf16 one live in separate folders (a cache serves only runs whose
# target runs in its dtype).
FEATURES="${FEATURES:-$D16K/features-layers-1-8-14-20-27-float8$([[ $BENCH_DTYPE == float32 ]] || echo "-$BENCH_DTYPE")}"
stage_features() {
  local cores pids=() k=0; IFS=, read -ra cores <<< "$BASE2K_CORES"
  for c in "${cores[@]}"; do
    OMP_NUM_THREADS=1 taskset -c "$c" $DFLOW features --data $D16K --drafter results/base-2k3 --dtype "$BENCH_DTYPE" \
      --store-dtype float8 --out "$FEATURES" --shard "$k/${#cores[@]}" --no-progress & pids+=($!); k=$((k + 1))
  done
  for p in "${pids[@]}"; do wait "$p"; done
}
features_ready() {  # FEATURES holds a shard for every data shard, built with the target in the run's dtype
  [[ -f $FEATURES/features.json ]] && .venv/bin/python -c 'import sys
from pathlib import Path
from dflow.train.features import missing_shards, read_key
built = read_key(Path(sys.argv[2]))["target"]["dtype"]
sys.exit(built != sys.argv[3] or bool(missing_shards(sys.argv[2], sys.argv[1])))' $D16K "$FEATURES" "$BENCH_DTYPE"
}
stage_base2k() {
  ddp_split "$BASE2K_CORES"
  [[ -f results/base-2k/model.safetensors ]] || run runs/base-2k 245 DATA=$D16K INIT=results/base-2j2 STEPS=1300 \
    SEED=14 WARMUP=10 LR=3e-4 "${SPLIT[@]}"
  snapshot runs/base-2k results/base-2k
  [[ -f results/base-2k2/model.safetensors ]] || run runs/base-2k2 281 DATA=$D16K INIT=results/base-2k STEPS=1055 \
    SEED=15 WARMUP=10 LR=2.76e-4 "${SPLIT[@]}"
  snapshot runs/base-2k2 results/base-2k2
  if [[ $BASE2K == runs/base-2k3 && ! -d $BASE2K/checkpoint && -f results/base-2k3/model.safetensors &&
        ! -f results/base-2k3/train_state.json ]]; then
    echo "reproduce.sh: runs/base-2k3 is gone and its snapshot results/base-2k3 has no step to go on from" \
      "(scripts/snapshot_run.sh writes one)" >&2; exit 1
  fi
  # a lost runs/ starts its log from the committed one, so that the run's history stays in one file
  [[ -f $BASE2K.log || ! -f results/base-2k3/base-2k3.log ]] || cp results/base-2k3/base-2k3.log "$BASE2K.log"
  local cache=(); features_ready && cache=(--feature-cache "$FEATURES")
  run $BASE2K "${BASE2K_STOP:-$BASE2K_STEPS}" DATA=$D16K INIT=results/base-2k2 SNAPSHOT=results/base-2k3 \
    STEPS=$BASE2K_STEPS SEED=16 WARMUP=10 LR=2.33e-4 "${SPLIT[@]}" --block-size 4 "${cache[@]}"
}

# Branches of equal steps and data from the base (issue 14, step 2): (a) DFlash k = 0, (b) k = 2
# with plain masks (self-conditioning only), (c) DFlow k = 2. A lower peak than the base's and a
# short warmup: they refine an annealed drafter. (c) and (b) alternate in chunks of BRANCH_CHUNK
# steps, so that an interrupted stage leaves both at about the same step, paired by batch
# (scripts/compare_branches.py reads them at any point); (a), 4x cheaper a step, runs last.
# The peak: 1.5e-4 for these 4 sequences a step. The first pilot took the GPU base's 6e-4 (made for
# 32 a step) and all three fell below the base (docs/training.md, "The branches"); it reruns with
# BRANCH_LR=6e-4 BRANCH_SUFFIX= (folders runs/a, runs/b, runs/c).
BRANCH_CHUNK="${BRANCH_CHUNK:-100}"
BRANCH_LR="${BRANCH_LR:-1.5e-4}"
# BRANCH_BLOCK=B: the branches train on blocks of B (`dflow train --init BASE --block-size B` re-blocks the base's
# weights), the block they will decode in; unset, they keep the base's (16), as the -lr15 and -2j sets did. A k = 2
# step in blocks of 4 costs 2.7x less than in 16 (docs/training.md, "Training on the block it drafts").
BRANCH_BLOCK="${BRANCH_BLOCK:-}"
BF=(); [[ -n $BRANCH_BLOCK ]] && BF=(--block-size "$BRANCH_BLOCK")
BX="${BRANCH_SUFFIX--lr15}"
RA=runs/a$BX RB=runs/b$BX RC=runs/c$BX
# A branch whose run was lost with its machine stands as its committed snapshot, results/branches/<run> (drafter in
# bf16, metrics to its step): the benches and compare_branches.py read it, and training skips it. (a) of the -2j set
# was at step 300 when runs/a-2j was lost (session 35): runs/a-2j2 trains its last 300 steps from that snapshot
# (session 36), with a fresh optimizer (warmup 10), the rest of its cosine as a fresh one from its step-301 rate
# (8.12e-5), and a new data order (SEED=13: the same data set, other batches than (b) and (c) saw at steps 301-600).
# A finished branch's snapshot stands for it too, so that a bench journal (which records the drafters' weight
# hashes) outlives the machine.
last_step() { .venv/bin/python -c 'import json, sys; print(max(json.loads(l)["step"] for l in open(sys.argv[1])))' \
  "$1/metrics.jsonl" 2>/dev/null || echo 0; }
for v in RA RB RC; do
  s=results/branches/$(basename "${!v}")
  if [[ -f $s/model.safetensors ]] && { [[ ! -d ${!v}/checkpoint ]] || (( $(last_step "$s") >= BRANCH_STEPS )); }; then
    printf -v "$v" %s "$s"
  fi
done
A2=()
if [[ $RA == results/branches/a-2j ]]; then
  RA=runs/a-2j2; (( $(last_step results/branches/a-2j2) >= BRANCH_STEPS - 300 )) && RA=results/branches/a-2j2
  A2=("$RA" $((BRANCH_STEPS - 300)) DATA=$D16K INIT=results/branches/a-2j STEPS=$((BRANCH_STEPS - 300)) SEED=13
      LR=8.12e-5 WARMUP=10 ROUNDS=0)  # `branch` skips it once its snapshot is final
fi
# The branches' benches, audit and serving bench write to folders of the same suffix, so each set keeps its
# own journals (the pilot's, BRANCH_SUFFIX=, are results/bench-t0 and so on).
T0=results/bench-t0$BX T1=results/bench-t1$BX FP32=results/audit-fp32$BX
B=(DATA=$D16K INIT=$BASE STEPS=$BRANCH_STEPS SEED=2 LR=$BRANCH_LR WARMUP=30)
if [[ $BENCH_DTYPE == float32 ]]; then B+=(DTYPE=float32 AUTOCAST=--no-bf16); fi  # all three alike, on such a CPU
branch() { [[ $1 == results/* ]] || run "$@"; }  # a snapshot of a lost run stands as it is
stage_branches() {
  local s=0
  while (( s < BRANCH_STEPS )); do
    s=$(( s + BRANCH_CHUNK < BRANCH_STEPS ? s + BRANCH_CHUNK : BRANCH_STEPS ))
    branch $RC "$s" "${B[@]}" ROUNDS=2 -- "${BF[@]}"
    branch $RB "$s" "${B[@]}" ROUNDS=2 -- --no-relay "${BF[@]}"
  done
  if (( ${#A2[@]} )); then branch "${A2[@]}"; else branch $RA "$BRANCH_STEPS" "${B[@]}" ROUNDS=0 -- "${BF[@]}"; fi
  mkdir -p results/branches
  .venv/bin/python scripts/compare_branches.py $RC $RB --plot results/branches/paired$BX.png \
    --json results/branches/paired$BX.json | tee results/branches/paired$BX.md
}

# What a round costs per drafter depth and block size, so the tau each needs (issue 14: choose by speed).
stage_depth() {
  [[ -f results/depth.json ]] || OMP_NUM_THREADS=1 taskset -c 1 .venv/bin/python scripts/bench_depth.py \
    --layers 1,2,3,5 --blocks 4,8,16 --json results/depth.json
}

# The trained drafters at each block size, a short interleaved bench (10 prompts a dataset, T = 0):
# the benches below then draft blocks of BLOCK, the fastest `dflow` here (docs/training.md, "Depth
# and block size"; the drafters were trained with B = 16).
stage_blocks() {
  split_bench results/blocks$BX --methods ar --num-prompts 10 --max-new-tokens 256 --dtype "$BENCH_DTYPE" \
    --variant dflash-b4=dflash:4@$RA --variant dflash-b16=dflash:16@$RA \
    --variant dflow-b4=dflow:4@$RC --variant dflow-b8=dflow:8@$RC --variant dflow-b16=dflow:16@$RC
}
BLOCK="${BLOCK:-16}"  # set from stage_blocks' results/blocks$BX/report.md

BENCH=(--methods ar,pld --block-size "$BLOCK"
       --variant dflash=dflash@$RA --variant dflash-sc=dflash@$RB
       --variant dflow-relay-off=dflash@$RC --variant dflow=dflow@$RC
       --max-new-tokens 256 --dtype "$BENCH_DTYPE" --runtime-breakdown)
NUM_PROMPTS="${NUM_PROMPTS:-40}"

bench() {  # [CORE=N] bench OUT ARGS...: start, or resume the journaled run (the prompt count may grow),
  # pinned to core N when CORE is set (taskset runs programs, not shell functions: it goes inside)
  local out=$1; shift
  local resume=(); [[ -f $out/progress.jsonl ]] && resume=(--resume)
  ${CORE:+taskset -c "$CORE"} "$DFLOW" bench "$@" --out "$out" "${resume[@]}"
}
split_bench() {  # split_bench OUT ARGS...: even prompts on core 0, odd ones on core 1 (--shard), each share
  local out=$1; shift  # journaled in runs/ (starting from what OUT already holds), then merged into OUT
  local share=runs/$(basename "$out") from=(); [[ -f $out/progress.jsonl ]] && from=(--merge "$out")
  OMP_NUM_THREADS=1 CORE=0 bench "$share-s0" "$@" --shard 0/2 "${from[@]}" & local p0=$!
  OMP_NUM_THREADS=1 CORE=1 bench "$share-s1" "$@" --shard 1/2 "${from[@]}" & local p1=$!
  wait $p0; wait $p1
  OMP_NUM_THREADS=1 bench "$out" "$@" --merge "$share-s0" --merge "$share-s1"  # the shares' thread count, reported
}
stage_bench() { stage_bench_t0; stage_bench_t1; }
stage_bench_t0() { split_bench $T0 "${BENCH[@]}" --num-prompts "$NUM_PROMPTS"; }
stage_bench_t1() { split_bench $T1 "${BENCH[@]}" --num-prompts "$NUM_PROMPTS" --temperature 1 --seed 0; }
stage_audit() {
  split_bench $FP32 --methods ar --block-size "$BLOCK" --variant dflash=dflash@$RA --variant dflow=dflow@$RC \
    --num-prompts 10 --max-new-tokens 64 --dtype float32
}
stage_serve() {  # plain vLLM, DFlash (run a) and DFlow (run c) behind vLLM's server, one core
  taskset -c 0 .venv-vllm/bin/dflow bench-serve --concurrency 1,2,4,8 --datasets humaneval,gsm8k \
    --num-prompts 4 --max-new-tokens 256 --cpus 0 --drafter $RC --dflash-drafter $RA --block-size "$BLOCK" \
    --out results/serve$BX
}
stage_tables() {  # the bench tables into docs/results.md (T = 1 once it has run); the training table printed
  local t1=() first=()
  [[ -f $T1/results.json ]] && t1=(--t1 "$T1")
  (( ${#A2[@]} )) && first=(dflash-first-300=results/branches/a-2j)  # (a) of -2j: two runs, one row each
  .venv/bin/python scripts/results_tables.py --t0 $T0 "${t1[@]}" \
    --fp32 $FP32 --into docs/results.md
  .venv/bin/python scripts/results_tables.py --t0 $T0 \
    --train base=$BASE "${first[@]}" dflash=$RA dflash-sc=$RB dflow=$RC | sed -n '/^## Training cost/,$p'
}

for stage in "${@:-base base2j branches depth blocks bench audit serve tables}"; do
  for s in $stage; do "stage_$s"; done
done
