"""Join a lease's returned drafter (scripts/lease/train.sh: model-N.safetensors, config.json,
metrics.jsonl in FOLDER) into a drafter folder OUT that `dflow` loads.

    python scripts/lease/unpack.py /work/.device/N runs/lease-N
"""

import shutil
import sys
from pathlib import Path

from safetensors.torch import load_file, save_file

src, out = Path(sys.argv[1]), Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
weights = {}
for part in sorted(src.glob("model-*.safetensors")):
    weights.update(load_file(str(part)))
if not weights:
    sys.exit(f"{src} holds no model-N.safetensors")
save_file(weights, str(out / "model.safetensors"))
for name in ("config.json", "metrics.jsonl", "train.log"):
    if (src / name).exists():
        shutil.copy(src / name, out / name)
print(f"{out}: {len(weights)} tensors")
