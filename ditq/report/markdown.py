"""REPORT.md: the report's blocks (document.py) as Markdown, images linked relative to the report directory.

Text the report did not write (prompts, notes, fixture and candidate ids, messages) is escaped: ``&``, ``<`` and
``>`` as HTML entities, so a Markdown viewer never renders it as HTML (report.html escapes it likewise), and a
code span holding a backtick is fenced with two.
"""

from __future__ import annotations

import html
from pathlib import Path

from ditq.report.assess import ReportData
from ditq.report.document import (
    Block,
    Bullets,
    Figure,
    Figures,
    Heading,
    Lead,
    Paragraph,
    Span,
    report_blocks,
)
from ditq.report.grids import Grid
from ditq.report.tables import Table

__all__ = ["render_markdown", "table_markdown"]

_MARKS = {"": "", "bold": "**", "code": "`", "italic": "*"}


def _text(text: str) -> str:
    """Plain Markdown text that renders as the characters it holds: no HTML gets through."""
    return html.escape(text, quote=False)


def _code(text: str) -> str:
    fence = "``" if "`" in text else "`"
    pad = " " if fence == "``" else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _escape(cell: str) -> str:
    return _text(cell).replace("|", "\\|").replace("\n", " ")


def table_markdown(table: Table) -> str:
    lines = [
        "| " + " | ".join(_escape(h) for h in table.headers) + " |",
        "| " + " | ".join("---" for _ in table.headers) + " |",
    ]
    lines += ["| " + " | ".join(_escape(c) for c in row) + " |" for row in table.rows]
    return "\n".join(lines)


def _spans(spans: tuple[Span, ...]) -> str:
    return "".join(
        _code(text) if style == "code" else f"{_MARKS[style]}{_text(text)}{_MARKS[style]}"
        for text, style in spans
    )


def _block(block: Block, out_dir: Path) -> str:
    if isinstance(block, Heading):
        return "#" * block.level + " " + _text(block.text + (block.verdict or ""))
    if isinstance(block, Paragraph):
        return _spans(block.spans)
    if isinstance(block, Bullets):
        return "\n".join(f"- {_spans(item)}" for item in block.items)
    if isinstance(block, Figures):
        return _figures(block.figures, out_dir)
    if isinstance(block, Lead):  # the first screen's text, then its figures
        return "\n\n".join(
            [*(_block(part, out_dir) for part in block.text), _figures(block.figures, out_dir)]
        )
    return table_markdown(block)


def _figures(figures: tuple[Figure, ...], out_dir: Path) -> str:
    return "\n\n".join(
        f"![{_text(f.title)}]({f.path.relative_to(out_dir).as_posix()})"
        + (f"\n\n*{_text(f.caption)}*" if f.caption else "")
        for f in figures
    )


def render_markdown(
    report: ReportData, charts: dict[str, Path | None], grids: list[Grid], out_dir: Path
) -> str:
    return "\n\n".join(_block(block, out_dir) for block in report_blocks(report, charts, grids)) + "\n"
