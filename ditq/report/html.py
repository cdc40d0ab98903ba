"""report.html: one self-contained file (styles, script and images inline) that opens offline.

A small inline script marks the document once every image has decoded: ``data-images``
on <html> becomes "N/M loaded" and ``data-errors`` counts script and resource errors, so
a headless browser (tests/report/test_browser.py) can check the page without a display.
"""

from __future__ import annotations

import base64
import html
from pathlib import Path

from ditq.report.assess import ReportData
from ditq.report.charts import CHARTS
from ditq.report.grids import Grid
from ditq.report.tables import (
    Table,
    capacity_table,
    comparison_table,
    provenance_table,
    stages_table,
    verdict_table,
)

__all__ = ["CHECK_SCRIPT", "data_uri", "render_html", "table_html"]

_STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2rem auto;max-width:1200px;
color:#1d1d1f;padding:0 1rem;line-height:1.4}
table{border-collapse:collapse;margin:0.6rem 0 1.2rem;font-size:0.85rem}
th,td{border:1px solid #d0d0d5;padding:0.25rem 0.5rem;text-align:left;vertical-align:top}
th{background:#f2f2f5} .YES{color:#0a7a2f;font-weight:700} .NO{color:#b00020;font-weight:700}
figure{margin:0.8rem 0} .grids{display:flex;flex-wrap:wrap;gap:0 1.5rem;align-items:flex-start} figcaption{font-size:0.8rem;color:#555} img{max-width:100%;height:auto}
code{background:#f2f2f5;padding:0 0.2rem}
"""

# Runs before anything else: counts errors (resource errors do not bubble, hence capture) and
# reports, once the page has loaded, how many images decoded to a real size.
CHECK_SCRIPT = """
(function(){var root=document.documentElement;var errors=0;root.dataset.errors="0";
window.addEventListener("error",function(){errors+=1;root.dataset.errors=String(errors);},true);
window.addEventListener("load",function(){var images=Array.prototype.slice.call(document.images);
var ok=images.filter(function(i){return i.complete&&i.naturalWidth>0;}).length;
root.dataset.images=ok+"/"+images.length+" loaded";});})();
"""


def data_uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode("ascii")


def _e(text: str) -> str:
    return html.escape(text, quote=True)


def table_html(table: Table, verdict_column: str | None = "Verdict") -> str:
    column = table.headers.index(verdict_column) if verdict_column in table.headers else -1
    head = "".join(f"<th>{_e(h)}</th>" for h in table.headers)
    body = []
    for row in table.rows:
        cells = []
        for index, cell in enumerate(row):
            klass = f' class="{_e(cell)}"' if index == column and cell in ("YES", "NO") else ""
            cells.append(f"<td{klass}>{_e(cell)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _figure(path: Path, caption: str) -> str:
    return f'<figure><img src="{data_uri(path)}" alt="{_e(caption)}"><figcaption>{_e(caption)}</figcaption></figure>'


def render_html(report: ReportData, charts: dict[str, Path | None], grids: list[Grid]) -> str:
    budget = report.document.memory_budget or "the whole device"
    parts = [
        "<h1>ditq report</h1>",
        f"<p>Baseline: <b>{_e(report.baseline.name)}</b> (<code>{_e(report.document.baseline.run)}</code>). "
        f"Memory budget: <b>{_e(budget)}</b>. Generated {_e(report.document.generated_utc)}.</p>",
        "<h2>Verdicts</h2>",
        table_html(verdict_table(report)),
        f"<h2>Comparison with {_e(report.baseline.name)} and between candidates</h2>",
        "<p>Seconds per image by reference count; (×N) is the speed-up over the baseline at the same count.</p>",
        table_html(comparison_table(report)),
        f"<h2>{_e(report.baseline.name)} (baseline) capacity matrix</h2>",
        table_html(capacity_table(report.baseline_matrix)),
    ]
    for a in report.assessments:
        parts.append(
            f'<h2 id="{_e(a.candidate.name)}">{_e(a.candidate.name)}: <span class="{a.verdict}">{a.verdict}</span></h2>'
        )
        facts = [
            f"scheme <code>{_e(a.candidate.scheme or 'n/a')}</code>",
            f"artifact digest <code>{_e(a.candidate.artifact_digest or 'n/a')}</code>",
        ]
        if a.floor_db is not None:
            facts.append(f"parity floor {a.floor_db:.2f} dB")
        if a.candidate.endpoint:
            facts.append(f"probed through <code>{_e(a.candidate.endpoint)}</code>")
        if a.candidate.memory_budget:
            facts.append(f"memory budget {_e(a.candidate.memory_budget)}")
        parts.append("<p>" + "; ".join(facts) + ".</p>")
        items = "".join(f"<li><b>{_e(r.code)}</b>: {_e(r.message)}</li>" for r in a.reasons)
        parts.append(f"<ul>{items or '<li>Every check passed.</li>'}</ul>")
        if a.matrix:
            parts.append(table_html(capacity_table(a.matrix)))
        if a.candidate.stages:
            parts.append(table_html(stages_table(a.candidate)))
        figures = []
        for grid in (g for g in grids if g.candidate == a.candidate.name):
            seeds = ", ".join(str(s) for s in grid.seeds)
            caption = f"{grid.fixture_id}: {report.baseline.name} | {grid.candidate} | amplified difference, seeds {seeds}"
            figures.append(_figure(grid.path, caption))
        if figures:
            parts.append(f'<div class="grids">{"".join(figures)}</div>')
    parts.append("<h2>Charts</h2>")
    for name, (title, _) in CHARTS.items():
        path = charts.get(name)
        if path is None:
            parts.append(
                f"<p><i>{_e(title)}: nothing to draw (no run has these numbers; memory is sampled on GPUs only).</i></p>"
            )
        else:
            parts.append(_figure(path, title))
    parts += ["<h2>Provenance</h2>", table_html(provenance_table(report), None)]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1"><link rel="icon" href="data:,">'
        f"<title>ditq report</title><script>{CHECK_SCRIPT}</script><style>{_STYLE}</style></head>"
        f"<body>{''.join(parts)}</body></html>\n"
    )
