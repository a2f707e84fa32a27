#!/bin/bash
# Issue 14's base stage: DFlash (k = 0) training of the default target's drafter with the issue-18
# recipe (a 2-layer drafter fusing 5 target layers: docs/training.md), DDP over both cores,
# resumable. Run it again to continue (it passes --resume when OUT holds a checkpoint); stop it with
# `kill -TERM` on the torchrun process (the run checkpoints its last finished step first).
# scripts/snapshot_run.sh copies the latest drafter (bf16) and metrics.jsonl to results/base-run/ for committing.
#
#   setsid nohup scripts/base_run.sh [FLAGS...] >> runs/base-l2.log 2>&1 &
#       env: OUT, DATA, INIT, STEPS, STOP (--stop-at: checkpoint there and exit), SEED, LR, WARMUP, ROUNDS,
#       SNAPSHOT (a scripts/snapshot_run.sh folder of this run: when OUT holds no checkpoint, the run goes on from
#       the snapshot's step with a fresh optimizer, --resume-from),
#       NPROC, CORES, DTYPE (the target's weights), AUTOCAST (--bf16 or --no-bf16 for the drafter); both
#       default to bf16 where the CPU multiplies bf16 natively (AVX-512 or AMX: dflow.targets.fast_bf16) and to
#       DTYPE=float32 AUTOCAST=--no-bf16 on one that does not (AVX2: bf16 matmuls ~80x slower there);
#       ANCHORS (--anchors-per-seq): 128 with bf16, 256 on such a CPU, where the float32 context forward is
#       three quarters of a step and a denser draw of blocks from it costs less per unit of gradient noise
#       (scripts/probe_anchor_noise.py; docs/training.md "Anchors a sequence, by machine"); a resume may change it;
#       FLAGS go to `dflow train` as they are (e.g. --no-relay for a branch)
#
# A later stage on more data starts from the last one's drafter with a fresh optimizer and schedule,
# no anchor bias (the drafter already attends to its anchor), and the new folder's own held-out
# conversations (its step-0 evaluation is the join of the two curves):
#
#   OUT=runs/base-l2-16k DATA=data/smollm2-135m-sharegpt-16k INIT=runs/base-l2 STEPS=16200 \
#       setsid nohup scripts/base_run.sh >> runs/base-l2-16k.log 2>&1 &
#
# A run whose folder was lost goes on from its committed snapshot with the same flags and SNAPSHOT set:
# the same step, schedule and data order, a fresh optimizer (`dflow train --resume-from`). A snapshot
# without a step (written before train_state.json was kept, session 40) starts a new run instead: INIT
# set to it and a new SEED, so that its data order does not replay the first batches of the stage it continues.
set -euo pipefail
out=${OUT:-runs/base-l2}
data=${DATA:-data/smollm2-135m-sharegpt-6400}
resume=() stop=() start=(--draft-vocab 8192 --block-bias 4 --block-bias-steps 300)
[ -n "${INIT:-}" ] && start=(--init "$INIT" --block-bias 0)
if [ -d "$out/checkpoint" ]; then resume=(--resume)
elif [ -n "${SNAPSHOT:-}" ] && [ -f "$SNAPSHOT/train_state.json" ]; then resume=(--resume-from "$SNAPSHOT"); fi
[ -n "${STOP:-}" ] && stop=(--stop-at "$STOP")
if ! .venv/bin/python -c 'import sys, torch; from dflow.targets import fast_bf16
sys.exit(not fast_bf16(torch.device("cpu")))'; then
    [ -z "${DTYPE:-}" ] && DTYPE=float32 AUTOCAST=${AUTOCAST:---no-bf16}
    ANCHORS=${ANCHORS:-256}
fi
export OMP_NUM_THREADS=1
exec taskset -c "${CORES:-0,1}" .venv/bin/torchrun --nproc-per-node "${NPROC:-2}" -m dflow.train \
    --data "$data" --out "$out" --rounds "${ROUNDS:-0}" --dtype "${DTYPE:-bfloat16}" "${AUTOCAST:---bf16}" --compile \
    --layers 2 --target-layers 5 --batch-size 2 --anchors-per-seq "${ANCHORS:-128}" --lr "${LR:-1.2e-3}" --warmup "${WARMUP:-100}" \
    --loss-gamma 1 "${start[@]}" --max-len 1536 --max-steps "${STEPS:-18000}" \
    --save-every 100 --eval-every 900 --eval-samples 24 --eval-tokens 64 --seed "${SEED:-0}" --no-progress "${stop[@]}" "${resume[@]}" "$@"
