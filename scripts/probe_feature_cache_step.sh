#!/usr/bin/env bash
# What a step of 2k3 costs with the float8 feature cache against the live target forward: 9 k = 0 steps of 2
# sequences from 2k3's snapshot (blocks of 4, one core), on a data folder of the 16K set's first two shards and a
# cache of those two shards that this script builds with `dflow features` (timed: the build's CPU-seconds a token
# say what the whole cache costs). Prints the build's cost and each mode's CPU-seconds over steps 2-9 and its losses.
# The dtype and anchors are the run's on this CPU (scripts/base_run.sh): float32 and 256 anchors where bf16 matmuls
# are not native (AVX2), bf16 and 128 where they are; DTYPE=float32|bfloat16 and ANCHORS override them.
#
#   scripts/probe_feature_cache_step.sh [CORE] [OUT]      (default core 1, /tmp/feature-cache-step)
set -euo pipefail
cd "$(dirname "$0")/.."
core=${1:-1} out=${2:-/tmp/feature-cache-step}
data=data/smollm2-135m-sharegpt-16k
dtype=${DTYPE:-$(.venv/bin/python -c 'import torch; from dflow.targets import fast_bf16
print("bfloat16" if fast_bf16(torch.device("cpu")) else "float32")')}
if [[ $dtype == bfloat16 ]]; then autocast=--bf16 anchors=${ANCHORS:-128}; else autocast=--no-bf16 anchors=${ANCHORS:-256}; fi
rm -rf "$out" && mkdir -p "$out/data"
cp $data/shard-0000{0,1}.safetensors "$out/data/"
.venv/bin/python -c 'import json, sys
meta = json.load(open(sys.argv[1])); meta["shards"] = meta["shards"][:2]; json.dump(meta, open(sys.argv[2], "w"))' \
  $data/meta.json "$out/data/meta.json"
export OMP_NUM_THREADS=1
taskset -c "$core" .venv/bin/python - "$out" "$dtype" <<'EOF'
import json, resource, subprocess, sys
from safetensors import safe_open
out, dtype = sys.argv[1], sys.argv[2]
cmd = [".venv/bin/dflow", "features", "--data", f"{out}/data", "--drafter", "results/base-2k3", "--dtype", dtype,
       "--store-dtype", "float8", "--out", f"{out}/cache", "--no-progress"]
subprocess.run(cmd, check=True, stdout=open(f"{out}/features.log", "w"), stderr=subprocess.STDOUT)
ru = resource.getrusage(resource.RUSAGE_CHILDREN)
tokens = 0
for s in json.load(open(f"{out}/data/meta.json"))["shards"]:
    with safe_open(f"{out}/data/{s}", "pt") as f:
        tokens += sum(f.get_slice(k).get_shape()[-1] for k in f.keys() if k == "input_ids")
cpu = ru.ru_utime + ru.ru_stime
print(f"cache build ({dtype}): {cpu:.1f} CPU-s for {tokens} tokens, {1000 * cpu / tokens:.2f} ms a token a core")
EOF
for mode in live cache; do
  extra=(); [[ $mode == cache ]] && extra=(--feature-cache "$out/cache")
  taskset -c "$core" .venv/bin/dflow train --data "$out/data" --out "$out/$mode" --rounds 0 \
    --init results/base-2k3 --block-size 4 --dtype "$dtype" "$autocast" --compile --batch-size 2 --anchors-per-seq "$anchors" \
    --lr 1e-4 --warmup 10 --loss-gamma 1 --block-bias 0 --max-len 1536 --max-steps 9 --save-every 100 \
    --eval-every 0 --eval-samples 0 --seed 2 --no-progress "${extra[@]}" > "$out/$mode.log" 2>&1
  .venv/bin/python -c 'import json, sys
r = [json.loads(line) for line in open(sys.argv[2])]
cpu, losses = sum(x["cpu_s"] for x in r[1:9]), [round(x["loss"], 4) for x in r[:9]]
print(f"{sys.argv[1]}: {cpu:.2f} CPU-s over steps 2-9; losses {losses}")' $mode "$out/$mode/metrics.jsonl"
done
