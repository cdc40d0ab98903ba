"""REPORT.md: the report's blocks (document.py) as Markdown, images linked relative to the report directory."""

from __future__ import annotations

from pathlib import Path

from ditq.report.assess import ReportData
from ditq.report.document import Block, Bullets, Figures, Heading, Paragraph, Span, report_blocks
from ditq.report.grids import Grid
from ditq.report.tables import Table

__all__ = ["render_markdown", "table_markdown"]

_MARKS = {"": "", "bold": "**", "code": "`", "italic": "*"}


def _escape(cell: str) -> str:
    return cell.replace("|", "\\|").replace("\n", " ")


def table_markdown(table: Table) -> str:
    lines = [
        "| " + " | ".join(_escape(h) for h in table.headers) + " |",
        "| " + " | ".join("---" for _ in table.headers) + " |",
    ]
    lines += ["| " + " | ".join(_escape(c) for c in row) + " |" for row in table.rows]
    return "\n".join(lines)


def _spans(spans: tuple[Span, ...]) -> str:
    return "".join(f"{_MARKS[style]}{text}{_MARKS[style]}" for text, style in spans)


def _block(block: Block, out_dir: Path) -> str:
    if isinstance(block, Heading):
        return "#" * block.level + " " + block.text + (block.verdict or "")
    if isinstance(block, Paragraph):
        return _spans(block.spans)
    if isinstance(block, Bullets):
        return "\n".join(f"- {_spans(item)}" for item in block.items)
    if isinstance(block, Figures):
        return "\n\n".join(
            f"![{f.title}]({f.path.relative_to(out_dir).as_posix()})"
            + (f"\n\n*{f.caption}*" if f.caption else "")
            for f in block.figures
        )
    return table_markdown(block)


def render_markdown(
    report: ReportData, charts: dict[str, Path | None], grids: list[Grid], out_dir: Path
) -> str:
    return "\n\n".join(_block(block, out_dir) for block in report_blocks(report, charts, grids)) + "\n"
