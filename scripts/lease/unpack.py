"""Join a lease's returned drafter (scripts/lease/train.sh: model-N.safetensors, the first holding
config.json in its metadata, and metrics.jsonl in FOLDER) into a drafter folder OUT that `dflow`
loads; a branches call's FOLDER/c and FOLDER/b (a branch-a call's FOLDER/a) into OUT/c, OUT/b (OUT/a).

    python scripts/lease/unpack.py /work/.device/N runs/lease-N
"""

import shutil
import sys
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import load_file, save_file


def unpack(src: Path, out: Path) -> None:
    weights = {}
    for part in sorted(src.glob("model-*.safetensors")):
        weights.update(load_file(str(part)))
    if not weights:
        sys.exit(f"{src} holds no model-N.safetensors")
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"))
    with safe_open(str(src / "model-0.safetensors"), "pt") as f:
        config = (f.metadata() or {}).get("config.json")
    if config is not None:  # train.sh sends it there
        (out / "config.json").write_text(config)
    for name in ("config.json", "metrics.jsonl", "train.log"):
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    print(f"{out}: {len(weights)} tensors")


src, out = Path(sys.argv[1]), Path(sys.argv[2])
branches = [b for b in "cba" if (src / b).is_dir()]
for b in branches:
    unpack(src / b, out / b)
if (src / "train.log").exists():
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "train.log", out / "train.log")
if not branches:
    unpack(src, out)
