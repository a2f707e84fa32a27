"""Turn benchmark results into `results.json`, a Markdown report and PNG plots.

Input shape (written by the bench runner; per-round entries come from `dflow.metrics`):
`results[dataset][method] = {"tau", "tau_per_sample", "tokens_per_s", "speedup",
"accept_by_position", "accepted_histogram", "time_split_ms", "mismatches", "num_prompts",
"num_tokens", "prefill_s", ...}`. `add_overall` derives `results["overall"]` like the paper's
Table 1 "Avg." column. Non-finite numbers (nan) are written as null in JSON and "n/a" in text.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from dflow.metrics import STAGES

OVERALL = "overall"
MEAN_KEYS = ("tau", "tau_per_sample", "mean_accepted", "speedup", "tokens_per_s")
SUM_KEYS = ("mismatches", "num_prompts", "num_tokens", "num_rounds", "prefill_s")

Results = Mapping[str, Mapping[str, Mapping[str, Any]]]


def _methods(results: Results) -> list[str]:
    """Methods in order of first appearance."""
    return list(dict.fromkeys(m for cells in results.values() for m in cells))


def _datasets(results: Results) -> list[str]:
    return [d for d in results if d != OVERALL]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _shared(cells: list[Mapping[str, Any]], key: str) -> list[Any] | None:
    """The values of `key` in all cells, or None when some cell lacks it."""
    return [c[key] for c in cells] if all(key in c for c in cells) else None


def _same_length(lists: list[Any] | None) -> bool:
    return lists is not None and len({len(x) for x in lists}) == 1


def add_overall(results: Results) -> dict[str, dict[str, dict[str, Any]]]:
    """A copy of `results` with `results["overall"][method]` over the datasets that ran it.

    Plain mean over datasets of tau, tau_per_sample, mean_accepted, speedup, tokens_per_s,
    accept_by_position (per position) and time_split_ms (per stage); sum of mismatches,
    num_prompts, num_tokens, num_rounds, prefill_s and accepted_histogram. A key is aggregated
    only when every dataset of that method has it. `datasets` lists the datasets averaged.
    """
    out = {d: {m: dict(cell) for m, cell in results[d].items()} for d in _datasets(results)}
    overall: dict[str, dict[str, Any]] = {}
    for method in _methods(out):
        names = [d for d in out if method in out[d]]
        cells = [out[d][method] for d in names]
        entry: dict[str, Any] = {"datasets": names}
        for key in MEAN_KEYS:
            if (values := _shared(cells, key)) is not None:
                entry[key] = _mean(values)
        for key in SUM_KEYS:
            if (values := _shared(cells, key)) is not None:
                entry[key] = None if None in values else sum(values)  # None: not measured (audit off)
        if _same_length(rates := _shared(cells, "accept_by_position")):
            entry["accept_by_position"] = [_mean(list(col)) for col in zip(*rates)]
        if _same_length(counts := _shared(cells, "accepted_histogram")):
            entry["accepted_histogram"] = [sum(col) for col in zip(*counts)]
        if (splits := _shared(cells, "time_split_ms")) is not None:
            entry["time_split_ms"] = {k: _mean([s[k] for s in splits]) for k in splits[0]}
        overall[method] = entry
    out[OVERALL] = overall
    return out


def _fmt(x: Any, spec: str = ".2f", suffix: str = "") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    return f"{x:{spec}}{suffix}"


def format_runtime_breakdown(time_split_ms_by_method: Mapping[str, Mapping[str, float]]) -> str:
    """A text table of ms per round and share of the round for each stage (the paper's Figure 3)."""
    header = ["method", *(f"{s} ms (%)" for s in STAGES), "total ms"]
    rows = [header]
    for method, split in time_split_ms_by_method.items():
        total = sum(split[s] for s in STAGES)
        shares = [split[s] / total * 100 if total > 0 else math.nan for s in STAGES]
        rows.append(
            [method]
            + [f"{_fmt(split[s])} ({_fmt(p, '.1f', '%')})" for s, p in zip(STAGES, shares)]
            + [_fmt(total)]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    aligned = [[row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])] for row in rows]
    return "\n".join("  ".join(row) for row in aligned)


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _has_acceptance(cell: Mapping[str, Any]) -> bool:
    """False for autoregressive rows, whose rates are all nan (nothing was drafted)."""
    rates = cell.get("accept_by_position") or []
    return any(isinstance(r, (int, float)) and math.isfinite(r) for r in rates)


def _table1(results: Results) -> list[str]:
    columns = [*_datasets(results), OVERALL]
    rows = [
        [m] + [
            f"{_fmt(results[d][m].get('tau'))} / {_fmt(results[d][m].get('speedup'), '.2f', 'x')}"
            if m in results[d] else "-"
            for d in columns
        ]
        for m in _methods(results)
    ]
    return [
        "## Acceptance length and speedup (Table 1)", "",
        "Cells: tau (committed tokens per decode round, bonus included) / decode speedup over "
        "autoregressive decoding. Overall: plain mean over the datasets.", "",
        _md_table(["method", *columns], rows),
    ]


DETAIL_KEYS = (
    ("tau", ".3f"), ("tau_per_sample", ".3f"), ("tokens_per_s", ".1f"), ("speedup", ".2f"),
    ("num_prompts", ".0f"), ("num_tokens", ".0f"), ("prefill_s", ".2f"), ("mismatches", ".0f"),
)


def _details(results: Results) -> list[str]:
    rows = [
        [d, m] + [_fmt(cell.get(key), spec) for key, spec in DETAIL_KEYS]
        for d in [*_datasets(results), OVERALL]
        for m, cell in results[d].items()
    ]
    return ["## Details", "", _md_table(["dataset", "method", *(k for k, _ in DETAIL_KEYS)], rows)]


def _acceptance(overall: Mapping[str, Mapping[str, Any]]) -> list[str]:
    out = ["## Acceptance rate by draft position (overall)", ""]
    accepting = {m: cell["accept_by_position"] for m, cell in overall.items() if _has_acceptance(cell)}
    if not accepting:
        return out + ["No method drafted tokens."]
    width = max(len(rates) for rates in accepting.values())
    rows = [[m] + [_fmt(r * 100, ".1f", "%") for r in rates] for m, rates in accepting.items()]
    return out + [_md_table(["method", *(f"d{j}" for j in range(1, width + 1))], rows)]


def _markdown(
    results: Results, skipped: Mapping[str, str], meta: Mapping[str, Any], plots: dict[str, Path],
    sections: Sequence[str] = (),
) -> str:
    overall = results[OVERALL]
    out = ["# DFlow evaluation report", ""]
    for key, value in meta.items():
        if isinstance(value, Mapping):
            value = ", ".join(f"{k} {v}" for k, v in value.items())
        out.append(f"- {key}: {value}")
    out += ["", *_table1(results), "", *_details(results), "", *_acceptance(overall), ""]

    splits = {m: cell["time_split_ms"] for m, cell in overall.items() if "time_split_ms" in cell}
    out += ["## Runtime split per decode round (overall)", ""]
    out += ["```text", format_runtime_breakdown(splits), "```"] if splits else ["No timings recorded."]

    out += ["", "## Mismatches", ""]
    for m, cell in overall.items():
        out.append(f"- {m}: mismatches = {_fmt(cell.get('mismatches'), '.0f')} "
                   f"({_fmt(cell.get('num_prompts'), '.0f')} prompts)")
    out += ["", "## Skipped datasets", ""]
    out += [f"- {d}: {reason.removeprefix(f'{d}: ')}" for d, reason in skipped.items()] or ["None."]
    for section in sections:
        out += ["", section]
    out += ["", "## Plots", ""]
    out += [f"![{name}]({path.name})" for name, path in plots.items()]
    return "\n".join(out) + "\n"


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def _grouped_bars(
    results: Results, key: str, title: str, path: Path, baseline: float | None = None
) -> Path:
    """One group per dataset (and overall), one bar per method."""
    columns = [*_datasets(results), OVERALL]
    methods = _methods(results)
    fig = Figure(figsize=(max(6.0, 1.4 * len(columns)), 4.0))
    ax = fig.add_subplot()
    width = 0.8 / max(1, len(methods))
    for i, method in enumerate(methods):
        heights = [results[d].get(method, {}).get(key) for d in columns]
        heights = [h if isinstance(h, (int, float)) and math.isfinite(h) else 0.0 for h in heights]
        offset = (i - (len(methods) - 1) / 2) * width
        ax.bar([x + offset for x in range(len(columns))], heights, width, label=method)
    if baseline is not None:
        ax.axhline(baseline, color="gray", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(columns)), columns)
    ax.set_title(title)
    if methods:
        ax.legend()
    return _save(fig, path)


def _acceptance_plot(results: Results, path: Path) -> Path:
    """One panel per dataset and overall; one line per method that drafted."""
    columns = [*_datasets(results), OVERALL]
    fig = Figure(figsize=(4.0 * len(columns), 3.5))
    for k, d in enumerate(columns):
        ax = fig.add_subplot(1, len(columns), k + 1)
        for method, cell in results[d].items():
            if _has_acceptance(cell):
                rates = [math.nan if r is None else r for r in cell["accept_by_position"]]
                ax.plot(range(1, len(rates) + 1), rates, marker="o", markersize=3, label=method)
        ax.set_title(d)
        ax.set_xlabel("draft position j")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(0, 1.05)
        if k == 0:
            ax.set_ylabel("P(d_j accepted)")
        if ax.get_lines():
            ax.legend(fontsize=8)
    return _save(fig, path)


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def write_report(
    out_dir: str | Path, results: Results, skipped: Mapping[str, str], meta: Mapping[str, Any],
    sections: Sequence[str] = (),
) -> dict[str, Path]:
    """Write results.json, report.md and the plots under `out_dir`; return their paths by kind.

    `results` holds the per-dataset cells; "overall" is (re)computed here with `add_overall`.
    `skipped` maps each dataset that did not run to its one-line reason; `meta` describes the run
    (command line, versions, dtype, machine); `sections` are extra Markdown sections (each with
    its own `##` heading) placed before the plots.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    full = add_overall(results)
    plots = {
        "tau_plot": _grouped_bars(
            full, "tau", "tau: committed tokens per decode round", out / "tau_per_dataset.png"
        ),
        "acceptance_plot": _acceptance_plot(full, out / "acceptance_by_position.png"),
        "speedup_plot": _grouped_bars(
            full, "speedup", "decode speedup over autoregressive", out / "speedup_per_dataset.png", 1.0
        ),
    }
    json_path = out / "results.json"
    payload = {"meta": meta, "results": full, "skipped": dict(skipped)}
    json_path.write_text(json.dumps(_jsonable(payload), indent=2, default=str, allow_nan=False) + "\n")
    md_path = out / "report.md"
    md_path.write_text(_markdown(full, skipped, meta, plots, sections))
    return {"json": json_path, "markdown": md_path, **plots}
