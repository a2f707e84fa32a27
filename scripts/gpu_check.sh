#!/usr/bin/env bash
# The device check: on one GPU, in under 5 minutes, with tiny random targets built on the spot (no
# downloads), lossless checks of ar, dflash and dflow in float32 and a short bf16 speed comparison;
# one summary line last (`gpu_check PASS ...` / `gpu_check FAIL ...`, exit code 1).
#
#   scripts/gpu_check.sh                 # DEVICE=cuda (the default): the GPU
#   DEVICE=cpu scripts/gpu_check.sh      # the same on the CPU (`make test` runs it so)
#
# PYTHON picks the interpreter (default: .venv/bin/python, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
DEVICE="${DEVICE:-cuda}"
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
if [ "$DEVICE" = cpu ]; then
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # tiny models: one thread is fastest
    REPEATS=1
else
    REPEATS=3
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # a bare python3 (a leased GPU) imports dflow from here
exec "$PYTHON" scripts/gpu_check.py --device "$DEVICE" --repeats "$REPEATS"
