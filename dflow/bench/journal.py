"""The bench's progress journal: every finished prompt's raw generations, appended as one JSON line,
so an interrupted or budget-limited run resumes where it stopped (`dflow bench --resume`).

Layout of `OUT/progress.jsonl`: a header line `{"settings": {...}}` (what must not change between a
run and its resumption), then one line per prompt: `{"dataset", "index", "prompt_sha",
"turns": {label: [generation, ...]}}`. A generation keeps everything the report is computed from
(ids, per-round stats, prefill/decode seconds, seconds in the call), so a resumed report is the
same as an uninterrupted one. A torn last line (the process killed mid-write) is ignored.

A bench split over processes or machines (one `--datasets` share each, every other setting the same)
is joined by `merge`: the finished prompts of the other journals are copied into this one, then the
run reports them all without generating them again.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from dflow.engine import GenerationResult
from dflow.metrics import RoundStats
from dflow.errors import DFlowError

FILE = "progress.jsonl"

Turns = dict[str, list[tuple[GenerationResult, float]]]  # label -> (result, seconds in the call) per turn


def prompt_sha(turns: list[str]) -> str:
    return hashlib.sha256(json.dumps(turns).encode()).hexdigest()[:16]


def _dump(result: GenerationResult, call_s: float) -> dict[str, Any]:
    return {"token_ids": result.token_ids, "rounds": [asdict(r) for r in result.rounds],
            "prefill_s": result.prefill_s, "decode_s": result.decode_s, "stopped": result.stopped,
            "call_s": call_s}


def _load(d: dict[str, Any]) -> tuple[GenerationResult, float]:
    rounds = [RoundStats(**r) for r in d["rounds"]]
    return GenerationResult(d["token_ids"], rounds, d["prefill_s"], d["decode_s"], d["stopped"]), d["call_s"]


def read_journal(path: Path, settings: dict[str, Any], flag: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """-> (header settings, finished-prompt records) of the journal at `path`; DFlowError when its
    settings differ from `settings` (`flag` names the option in the message)."""
    lines = path.read_text().splitlines()
    try:
        header = json.loads(lines[0])["settings"]
    except (IndexError, KeyError, json.JSONDecodeError):
        raise DFlowError(f"{path} has no settings header: not a dflow bench journal") from None
    changed = sorted(k for k in settings if header.get(k) != settings[k])  # what this run depends on
    if changed:
        k = changed[0]
        raise DFlowError(f"{flag}: {k} differs from the journal's run ({header.get(k)!r} there, "
                         f"{settings.get(k)!r} now); rerun with the same settings or another --out")
    records = []
    for line in lines[1:]:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a torn last line: that prompt runs again
            continue
    return header, records


class Journal:
    def __init__(self, out_dir: str | Path, settings: dict[str, Any], resume: bool):
        self.path = Path(out_dir) / FILE
        self.settings = settings
        self.saved: dict[tuple[str, int], dict[str, Any]] = {}
        if self.path.exists() and not resume:
            raise DFlowError(f"{self.path} exists (an earlier run): pass --resume to continue it, "
                             "or choose another --out")
        if resume and self.path.exists():
            self._read(settings)
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps({"settings": settings}) + "\n")

    def _read(self, settings: dict[str, Any]) -> None:
        header, records = read_journal(self.path, settings, "--resume")
        self.saved = {(rec["dataset"], rec["index"]): rec for rec in records}
        # Rewritten without a torn last line, atomically: another process may be merging from it.
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("\n".join(map(json.dumps, [{"settings": header}, *records])) + "\n")
        os.replace(tmp, self.path)

    def merge(self, other: str | Path) -> int:
        """Copy the prompts finished in the journal of run folder `other` (same settings) that this one
        lacks; -> how many were copied."""
        path = Path(other) / FILE
        if not path.exists():
            raise DFlowError(f"--merge {other}: no {FILE} there")
        _, records = read_journal(path, self.settings, f"--merge {other}")
        new = [rec for rec in records if (rec["dataset"], rec["index"]) not in self.saved]
        with self.path.open("a") as f:
            for rec in new:
                self.saved[(rec["dataset"], rec["index"])] = rec
                f.write(json.dumps(rec) + "\n")
        return len(new)

    def get(self, dataset: str, index: int, turns: list[str]) -> Turns | None:
        """The saved generations of this prompt, if an earlier run finished it (same prompt text)."""
        rec = self.saved.get((dataset, index))
        if rec is None or rec["prompt_sha"] != prompt_sha(turns):
            return None
        return {label: [_load(g) for g in gens] for label, gens in rec["turns"].items()}

    def put(self, dataset: str, index: int, turns: list[str], done: Turns) -> None:
        rec = {"dataset": dataset, "index": index, "prompt_sha": prompt_sha(turns),
               "turns": {label: [_dump(r, s) for r, s in gens] for label, gens in done.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())

    @property
    def num_saved(self) -> int:
        return len(self.saved)
