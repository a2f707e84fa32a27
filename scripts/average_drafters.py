"""The mean of saved drafters' weights (checkpoint averaging, a "soup" of one run's snapshots), as
a drafter folder that `dflow generate --drafter` and scripts/eval_heldout.py read.

    python scripts/average_drafters.py results/base-2k2 results/base-2k3 --out /tmp/avg

The drafters must share their architecture (config.json, the block size aside: no weight depends on
it) and their draft-vocabulary map; the first one's config is kept. Weights are averaged in float32
and written in the first drafter's stored dtype (--dtype to choose). Each drafter may be
FOLDER or REV:FOLDER, a committed snapshot read from git (`bc4bb0b:results/base-2j2`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

import torch

from dflow.errors import DFlowError
from dflow.model import load_drafter, save_drafter

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def materialise(spec: str, tmp: Path) -> Path:
    """FOLDER as is; REV:FOLDER's config.json and model.safetensors from git into a folder under `tmp`."""
    rev, sep, folder = spec.partition(":")
    if not sep:
        return Path(spec)
    out = tmp / f"{len(list(tmp.iterdir()))}"
    out.mkdir()
    for name in ("config.json", "model.safetensors"):
        try:
            blob = subprocess.run(["git", "show", f"{rev}:{folder.rstrip('/')}/{name}"], capture_output=True, check=True).stdout
        except subprocess.CalledProcessError as e:
            raise DFlowError(f"{spec}: {e.stderr.decode().strip()}") from None
        (out / name).write_bytes(blob)
    return out


def comparable(config):
    """A config less what no weight depends on (the block size, the stored dtype), at any depth."""
    if not isinstance(config, dict):
        return config
    return {k: comparable(v) for k, v in config.items() if k not in ("block_size", "dtype")}


def average(folders: list[Path]):
    """-> a drafter (float32) whose floating-point weights are the mean of `folders`' drafters'."""
    first = json.loads((folders[0] / "config.json").read_text())
    for f in folders[1:]:
        if comparable(json.loads((f / "config.json").read_text())) != comparable(first):
            raise DFlowError(f"{f} and {folders[0]} are drafters of different architectures (config.json)")
    drafters = [load_drafter(f) for f in folders]
    mean = drafters[0]
    states = [d.state_dict() for d in drafters]
    with torch.no_grad():
        for name, tensor in mean.state_dict().items():
            if tensor.is_floating_point():
                tensor.copy_(torch.stack([s[name].float() for s in states]).mean(0))
            elif any(not torch.equal(s[name], tensor) for s in states[1:]):
                raise DFlowError(f"the drafters differ in {name} (e.g. their draft-vocabulary map): not averageable")
    return mean


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("drafters", nargs="+", metavar="[REV:]FOLDER")
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="stored dtype (default: the first drafter's)")
    args = p.parse_args()
    if len(args.drafters) < 2:
        raise SystemExit("error: give two or more drafters to average")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            folders = [materialise(s, Path(tmp)) for s in args.drafters]
            stored = json.loads((folders[0] / "config.json").read_text()).get("dtype", "float32")
            mean = average(folders)
            save_drafter(mean, args.out, dtype=DTYPES[args.dtype or stored])
        except DFlowError as e:
            raise SystemExit(f"error: {e}") from None
    print(f"wrote the mean of {len(folders)} drafters to {args.out}")


if __name__ == "__main__":
    main()
