#!/usr/bin/env bash
# What a step of 2k3 costs with the float8 feature cache against the live target forward: 9 k = 0 steps of 2
# sequences from 2k3's snapshot (256 anchors, blocks of 4, float32, one core), on a data folder of the 16K set's
# first two shards and a cache of those two shards taken from the one `scripts/reproduce.sh features` builds
# (its shards 0 and 1 must be done). Prints each mode's CPU-seconds over steps 2-9 and its step losses.
#
#   scripts/probe_feature_cache_step.sh [CORE] [OUT]      (default core 1, /tmp/feature-cache-step)
set -euo pipefail
cd "$(dirname "$0")/.."
core=${1:-1} out=${2:-/tmp/feature-cache-step}
data=data/smollm2-135m-sharegpt-16k cache=$data/features-layers-1-8-14-20-27-float8
rm -rf "$out" && mkdir -p "$out/data" "$out/cache"
cp $data/shard-0000{0,1}.safetensors "$out/data/"
cp $cache/features.json $cache/shard-0000{0,1}.safetensors "$out/cache/"
.venv/bin/python -c 'import json, sys
meta = json.load(open(sys.argv[1])); meta["shards"] = meta["shards"][:2]; json.dump(meta, open(sys.argv[2], "w"))' \
  $data/meta.json "$out/data/meta.json"
for mode in live cache; do
  extra=(); [[ $mode == cache ]] && extra=(--feature-cache "$out/cache")
  OMP_NUM_THREADS=1 taskset -c "$core" .venv/bin/dflow train --data "$out/data" --out "$out/$mode" --rounds 0 \
    --init results/base-2k3 --block-size 4 --dtype float32 --no-bf16 --compile --batch-size 2 --anchors-per-seq 256 \
    --lr 1e-4 --warmup 10 --loss-gamma 1 --block-bias 0 --max-len 1536 --max-steps 9 --save-every 100 \
    --eval-every 0 --eval-samples 0 --seed 2 --no-progress "${extra[@]}" > "$out/$mode.log" 2>&1
  .venv/bin/python -c 'import json, sys
r = [json.loads(line) for line in open(sys.argv[2])]
cpu, losses = sum(x["cpu_s"] for x in r[1:9]), [round(x["loss"], 4) for x in r[:9]]
print(f"{sys.argv[1]}: {cpu:.2f} CPU-s over steps 2-9; losses {losses}")' $mode "$out/$mode/metrics.jsonl"
done
