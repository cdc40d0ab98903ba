"""REPORT.md: the report's blocks (document.py) as Markdown, images linked relative to the report directory.

Text the report did not write (prompts, notes, fixture and candidate ids, messages) cannot restructure the
report: every line break in it becomes a space, so it never starts a line; a character that would open a heading,
a quote, a list or a table row at the start of a text is escaped, and so are ``[``, ``]``, backticks and
backslashes anywhere (no link, no code span of its own); ``&``, ``<`` and ``>`` become HTML entities, so a
Markdown viewer never renders it as HTML (report.html escapes it likewise). A code span is fenced with more
backticks than it holds in a row.
"""

from __future__ import annotations

import html
import re
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


# every character that ends a line somewhere (str.splitlines' set): one of them would start a new Markdown line
_LINE_BREAKS = re.compile(r"[\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029]+")
_INLINE = re.compile(r"([\\`\[\]])")  # a link, a code span, an escape of its own
# what opens a block at the start of a line: a heading, quote, list, table row, rule, setext underline, fence
_BLOCK_START = re.compile(  # CommonMark's block openers: heading, quote, list item, table row, rule or fence
    r"^( ?)(#{1,6}(?=\s|$)|>|[-+*](?=\s|$)|\d{1,9}(?=[.)](?:\s|$))|\||[-_*=]{3,}|~{3,})"
)
_LEADING_SPACES = re.compile(r"^\s{2,}")  # four would open a code block


def _one_line(text: str) -> str:
    return _LINE_BREAKS.sub(" ", text)


def _text(text: str) -> str:
    """Plain Markdown text that renders as the characters it holds, on the line it is put on: no HTML, no link,
    no block of its own gets through."""
    escaped = _INLINE.sub(r"\\\1", html.escape(_one_line(text), quote=False))
    escaped = _LEADING_SPACES.sub(" ", escaped)

    def literal(match: re.Match[str]) -> str:  # "\#", "\-", ...; a list number's dot: "12\."
        space, mark = match.groups()
        return f"{space}{mark}\\" if mark[0].isdigit() else f"{space}\\{mark}"

    return _BLOCK_START.sub(literal, escaped)


def _code(text: str) -> str:
    text = _one_line(text)
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if longest else ""
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
    return "".join(_code(text) if style == "code" else _marked(text, _MARKS[style]) for text, style in spans)


def _marked(text: str, mark: str) -> str:
    """``text`` between ``mark``s, its leading and trailing spaces outside them: ``**bold: **`` does not close in
    CommonMark (a closing mark may not follow a space) and would show its asterisks."""
    if not mark or not text.strip():
        return _text(text)
    core = text.strip()
    before, after = text[: len(text) - len(text.lstrip())], text[len(text.rstrip()) :]
    return f"{_text(before)}{mark}{_text(core)}{mark}{_text(after)}"


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
