"""REPORT.md: the verdicts first, then the numbers behind them, then the pictures, then provenance."""

from __future__ import annotations

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

__all__ = ["render_markdown", "table_markdown"]


def _escape(cell: str) -> str:
    return cell.replace("|", "\\|").replace("\n", " ")


def table_markdown(table: Table) -> str:
    lines = [
        "| " + " | ".join(_escape(h) for h in table.headers) + " |",
        "| " + " | ".join("---" for _ in table.headers) + " |",
    ]
    lines += ["| " + " | ".join(_escape(c) for c in row) + " |" for row in table.rows]
    return "\n".join(lines)


def render_markdown(
    report: ReportData, charts: dict[str, Path | None], grids: list[Grid], out_dir: Path
) -> str:
    budget = report.document.memory_budget or "the whole device"
    parts = [
        "# ditq report",
        f"Baseline: **{report.baseline.name}** (`{report.document.baseline.run}`). "
        f"Memory budget: **{budget}**. Generated {report.document.generated_utc}.",
        "## Verdicts",
        table_markdown(verdict_table(report)),
        f"## Comparison with {report.baseline.name} and between candidates",
        "Seconds per image by reference count; (×N) is the speed-up over the baseline at the same count.",
        table_markdown(comparison_table(report)),
        f"## {report.baseline.name} (baseline) capacity matrix",
        table_markdown(capacity_table(report.baseline_matrix)),
    ]
    for a in report.assessments:
        parts.append(f"## {a.candidate.name}: {a.verdict}")
        facts = [
            f"scheme `{a.candidate.scheme or 'n/a'}`",
            f"artifact digest `{a.candidate.artifact_digest or 'n/a'}`",
        ]
        if a.floor_db is not None:
            facts.append(f"parity floor {a.floor_db:.2f} dB")
        if a.candidate.endpoint:
            facts.append(f"probed through {a.candidate.endpoint}")
        if a.candidate.memory_budget:
            facts.append(f"memory budget {a.candidate.memory_budget}")
        parts.append("; ".join(facts) + ".")
        parts.append("\n".join(f"- **{r.code}**: {r.message}" for r in a.reasons) or "- Every check passed.")
        if a.matrix:
            parts.append(table_markdown(capacity_table(a.matrix)))
        if a.candidate.stages:
            parts.append(table_markdown(stages_table(a.candidate)))
        for grid in (g for g in grids if g.candidate == a.candidate.name):
            parts.append(
                f"![{grid.candidate} {grid.fixture_id}]({grid.path.relative_to(out_dir).as_posix()})\n\n"
                f"*{grid.fixture_id}: {report.baseline.name} | {grid.candidate} | amplified difference, "
                f"seeds {', '.join(str(s) for s in grid.seeds)}*"
            )
    parts.append("## Charts")
    for name, (title, _) in CHARTS.items():
        path = charts.get(name)
        if path is None:
            parts.append(
                f"*{title}: nothing to draw (no run has these numbers; memory is sampled on GPUs only).*"
            )
        else:
            parts.append(f"![{title}]({path.relative_to(out_dir).as_posix()})")
    parts += ["## Provenance", table_markdown(provenance_table(report))]
    return "\n\n".join(parts) + "\n"
