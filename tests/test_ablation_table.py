"""scripts/ablation_table.py: a row's flags are its own, less ablate.sh's fixed settings and baseline."""

from __future__ import annotations

import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location("ablation_table", Path(__file__).parents[1] / "scripts" / "ablation_table.py")
table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(table)

FIXED = ("taskset -c 0 .venv/bin/python -m dflow.cli train --data runs/ablate-data --out runs/abl/X --rounds 0 "
         "--dtype bfloat16 --bf16 --compile --max-len 1536 --eval-samples 24 --eval-tokens 64 --save-every 50 --no-progress")


def log_of(flags: str) -> str:
    return f'\tCommand being timed: "{FIXED} {flags}"\n\tUser time (seconds): 10.0\n'


def test_the_baseline_and_fixed_settings_are_left_out():
    own = "--layers 2 --draft-vocab 8192 --block-bias 0 --lr 3e-4 --max-steps 1050"
    assert table.flags_of(log_of(f"{table.SHAPE} {table.BASELINE} {own}")) == own
    assert table.flags_of(log_of(f"{table.BASELINE} --init runs/x {own}")) == f"--init runs/x {own}"  # --init: no SHAPE
    assert table.flags_of(log_of(own)) == own  # rows from before the baseline was pinned
    assert table.cpu_seconds(log_of(own)) is None  # no system time line: unknown


def test_the_baseline_is_ablate_sh_s():
    sh = (Path(__file__).parents[1] / "scripts" / "ablate.sh").read_text()
    assert f"SHAPE=({table.SHAPE})" in sh and f"BASELINE=({table.BASELINE})" in sh


def test_rows_of_lost_runs_stay_and_found_runs_update_theirs():
    old = [{"name": "A", "tau": 1.1}, {"name": "B", "tau": 1.2}]
    new = [{"name": "C", "tau": 1.3}, {"name": "B", "tau": 1.25}]
    assert table.merge(old, new) == [{"name": "A", "tau": 1.1}, {"name": "B", "tau": 1.25}, {"name": "C", "tau": 1.3}]
