"""`dflow bench-serve`'s report: results.json, report.md and throughput.png (no vLLM import).

Input: `results[concurrency][method] = {"tokens_per_s", "speedup", "tau", "mean_accepted",
"accept_by_position", "mismatches", "num_tokens", "wall_s", ...}`, speedup over `ar` (plain vLLM)
at the same concurrency; tau and acceptance from vLLM's own spec-decode counters.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from matplotlib.figure import Figure

from dflow.report import _fmt, _jsonable, _md_table, _save

Results = Mapping[int, Mapping[str, Mapping[str, Any]]]


def _methods(results: Results) -> list[str]:
    return list(dict.fromkeys(m for cells in results.values() for m in cells))


def _table2(results: Results) -> list[str]:
    methods = _methods(results)
    rows = [[str(c)] + [f"{_fmt(cells[m]['tokens_per_s'], '.1f')} ({_fmt(cells[m].get('speedup'), '.2f', 'x')})"
                        if m in cells else "-" for m in methods] for c, cells in results.items()]
    return ["## Throughput by concurrency (Table 2)", "",
            "Cells: output tokens/s over all requests of the level (first request sent to last reply), "
            "(speedup over plain vLLM at the same concurrency).", "",
            _md_table(["concurrency", *methods], rows)]


def _acceptance(results: Results) -> list[str]:
    rows, width = [], 0
    for c, cells in results.items():
        for m, cell in cells.items():
            if cell.get("tau") is None:
                continue
            rates = cell.get("accept_by_position") or []
            width = max(width, len(rates))
            rows.append([str(c), m, _fmt(cell["tau"], ".3f"), str(cell.get("rounds", "n/a")),
                         _fmt(cell.get("mismatches"), ".0f"), " ".join(_fmt(r * 100, ".0f") for r in rates)])
    out = ["## vLLM's acceptance counters", "",
           "tau = 1 + accepted drafts / decode rounds (vllm:spec_decode_* counters of /metrics); "
           "acceptance by draft position j = 1.. in %; mismatches: outputs differing from plain vLLM's "
           "(greedy) at the same concurrency.", ""]
    if not rows:
        return out + ["No method drafted tokens."]
    return out + [_md_table(["concurrency", "method", "tau", "rounds", "mismatches", "accept % by position"], rows)]


def _plot(results: Results, path: Path) -> Path:
    """Grouped bars: one group per concurrency, one bar per method, the figure written on each bar."""
    levels, methods = list(results), _methods(results)
    fig = Figure(figsize=(max(6.0, 1.8 * len(levels)), 4.2))
    ax = fig.add_subplot()
    width = 0.8 / max(1, len(methods))
    for i, m in enumerate(methods):
        xs = [k + (i - (len(methods) - 1) / 2) * width for k in range(len(levels))]
        ys = [results[c].get(m, {}).get("tokens_per_s") or 0.0 for c in levels]
        bars = ax.bar(xs, ys, width, label=m)
        labels = []
        for c in levels:
            cell = results[c].get(m, {})
            s = cell.get("speedup")
            labels.append(f"{cell.get('tokens_per_s', 0):.0f}" + (f"\n{s:.2f}x" if s is not None and m != "ar" else ""))
        ax.bar_label(bars, labels=labels, fontsize=7, padding=2)
    ax.set_xticks(range(len(levels)), [str(c) for c in levels])
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tokens/s")
    ax.set_title("vLLM serving throughput (speedup over plain vLLM)")
    ax.margins(y=0.2)
    ax.legend()
    return _save(fig, path)


def write_serving_report(out_dir: str | Path, results: Results, meta: Mapping[str, Any],
                         skipped: Mapping[str, str]) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plot = _plot(results, out / "throughput.png")
    payload = {"meta": meta, "results": {str(c): cells for c, cells in results.items()}, "skipped": dict(skipped)}
    (out / "results.json").write_text(json.dumps(_jsonable(payload), indent=2, allow_nan=False) + "\n")
    md = ["# DFlow serving benchmark (vLLM)", ""]
    md += [f"- {k}: {v}" for k, v in meta.items()]
    md += ["", *_table2(results), "", *_acceptance(results), "", "## Skipped datasets", ""]
    md += [f"- {d}: {r}" for d, r in skipped.items()] or ["None."]
    md += ["", "## Plot", "", f"![throughput]({plot.name})", ""]
    (out / "report.md").write_text("\n".join(md))
    return {"json": out / "results.json", "markdown": out / "report.md", "plot": plot}
