#!/bin/bash
# Developers' kit for a leased GPU reached through a tool that sends the working tree (64 MiB a
# call, tracked files included) and keeps a machine only 30 s between calls. It packs what
# scripts/lease/train.sh needs into two carried folders and slims what travels:
#
#   scripts/lease/pack.sh pack     # .lease/a (45 MB of the GGUF, INIT's drafter), .lease/b (the rest, the
#                                  # gguf wheel, the data as xz); env INIT (default results/base-run), DATA
#                                  # (folders, space-separated: the first holds out, the rest are --extra-data)
#   scripts/lease/pack.sh slim     # only dflow/ (no assets), scripts/ and tests/ travel (the index is
#                                  # emptied: commit nothing until `unslim`)
#   scripts/lease/pack.sh unslim   # the index back from HEAD, .lease/ ignored
#
# Then, each call right after the last (docs/training.md, "On a GPU"):
#   1. carry [".lease/a"]: mkdir -p /root/lease && cp -r .lease/a/. /root/lease/ [&& scripts/gpu_check.sh]
#   2. carry [".lease/b"]: bash scripts/lease/train.sh SECONDS_OF_THE_CALL
#   3. nothing carried: bash scripts/lease/train.sh more SECONDS_LEFT
set -euo pipefail
cd "$(dirname "$0")/../.."
py=${PY:-.venv/bin/python}
case "${1:-}" in
pack)
    init=${INIT:-results/base-run} data=${DATA:-data/smollm2-135m-sharegpt-16k}
    gguf=$("$py" -c 'from dflow.targets import gguf_path; print(gguf_path("smollm2-135m"))')
    split=${SPLIT:-45000000}  # bytes of the GGUF in .lease/a, with the drafter: the two carries balanced
    rm -rf .lease && mkdir -p .lease/a/init .lease/b
    head -c "$split" "$gguf" > .lease/a/part
    tail -c +$(( split + 1 )) "$gguf" > .lease/b/part
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux2014_x86_64 -d .lease/b "gguf==$("$py" -c 'import importlib.metadata as m; print(m.version("gguf"))')"
    for d in $data; do [ -f "$d/meta.json" ] || { echo "pack.sh: $d is no dflow data folder" >&2; exit 2; }; done
    # each folder as its meta.json lists it (a build may be writing more shards meanwhile)
    rm -rf .lease/stage && mkdir -p .lease/stage
    "$py" - .lease/stage $data <<'PY'
import json, shutil, sys
from pathlib import Path
stage, folders = Path(sys.argv[1]), sys.argv[2:]
for f in map(Path, folders):
    meta = json.loads((f / "meta.json").read_text())
    (stage / f.name).mkdir()
    for name in meta["shards"]:
        shutil.copy(f / name, stage / f.name / name)
    (stage / f.name / "meta.json").write_text(json.dumps(meta))
    print(f"{f}: {len(meta['shards'])} shards")
PY
    tar -C .lease/stage -cf - . | xz -T1 -6 > .lease/b/data.tar.xz && rm -rf .lease/stage
    printf '%s\n' $data > .lease/b/data.path
    cp "$init/model.safetensors" "$init/config.json" .lease/a/init/
    grep -qx '/.lease/' .git/info/exclude 2>/dev/null || echo '/.lease/' >> .git/info/exclude
    du -sh .lease/a .lease/b
    for d in .lease/a .lease/b; do  # one call carries 64 MiB, the slimmed tree (under 1 MiB) included
        [ "$(du -sb "$d" | cut -f1)" -lt $(( 62 * 2**20 )) ] || { echo "pack.sh: $d is over 62 MiB" >&2; exit 2; }
    done ;;
slim)
    printf '/*\n!/dflow/\n!/scripts/\n!/tests/\n/dflow/assets/\n' > .git/info/exclude
    git rm -r -q --cached .
    echo "travels: $(git ls-files --others --exclude-standard | xargs du -cb | tail -1)" ;;
unslim)
    git reset -q
    printf '/.lease/\n' > .git/info/exclude
    git status --short | head ;;
*) sed -n 2,16p "$0"; exit 2 ;;
esac
