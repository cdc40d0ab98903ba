"""report.html: one self-contained file (styles, script and images inline) that opens offline.

A small inline script marks the document once every image has decoded: ``data-images``
on <html> becomes "N/M loaded" and ``data-errors`` counts script and resource errors, and it writes where the first
screen's answer and its images end (``data-answer-bottom``, ``data-answer-images``) beside the viewport, so a
headless browser (tests/report/test_report_browser.py) can check the page, and that the answer is above the fold,
without a display.
"""

from __future__ import annotations

import base64
import html
from pathlib import Path

from ditq.report.assess import ReportData
from ditq.report.document import Block, Bullets, Figures, Heading, Lead, Paragraph, Span, report_blocks
from ditq.report.grids import Grid
from ditq.report.tables import Table

__all__ = ["CHECK_SCRIPT", "data_uri", "render_html", "table_html"]

_STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2rem auto;max-width:1200px;
color:#1d1d1f;padding:0 1rem;line-height:1.4}
table{border-collapse:collapse;margin:0.6rem 0 1.2rem;font-size:0.85rem}
th,td{border:1px solid #d0d0d5;padding:0.25rem 0.5rem;text-align:left;vertical-align:top}
th{background:#f2f2f5} .YES{color:#0a7a2f;font-weight:700} .NO{color:#b00020;font-weight:700}
.UNDECIDED{color:#8a5a00;font-weight:700}
figure{margin:0.8rem 0} .grids{display:flex;flex-wrap:wrap;gap:0 1.5rem;align-items:flex-start} figcaption{font-size:0.8rem;color:#555} img{max-width:100%;height:auto}
code{background:#f2f2f5;padding:0 0.2rem}
.lead{display:flex;gap:1.5rem;align-items:flex-start} .lead-text{flex:1 1 0;min-width:0}
.lead-figures{flex:0 0 560px} .lead-figures figure{margin:0 0 0.6rem} .lead-text ul{padding-left:1.2rem}
h1{margin:0 0 0.4rem} .lead-text p,.lead-text li{font-size:0.95rem}
"""

# Runs before anything else: counts errors (resource errors do not bubble, hence capture) and
# reports, once the page has loaded, how many images decoded to a real size, the viewport, and how far down the
# page the first screen's answer (#answer) and each of its images end (CSS pixels from the top).
CHECK_SCRIPT = """
(function(){var root=document.documentElement;var errors=0;root.dataset.errors="0";
window.addEventListener("error",function(){errors+=1;root.dataset.errors=String(errors);},true);
window.addEventListener("load",function(){var images=Array.prototype.slice.call(document.images);
var ok=images.filter(function(i){return i.complete&&i.naturalWidth>0;}).length;
root.dataset.images=ok+"/"+images.length+" loaded";
root.dataset.viewport=window.innerWidth+"x"+window.innerHeight;
var answer=document.getElementById("answer");if(answer){var end=function(e){
return Math.round(e.getBoundingClientRect().bottom+window.scrollY);};root.dataset.answerBottom=String(end(answer));
root.dataset.answerImages=Array.prototype.map.call(answer.querySelectorAll("img"),end).join(",");}});})();
"""


def data_uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode("ascii")


def _e(text: str) -> str:
    return html.escape(text, quote=True)


_ANSWERS = ("YES", "NO", "UNDECIDED")


def table_html(table: Table) -> str:
    """Answer cells (YES, NO, UNDECIDED) carry their answer as a class, in any column."""
    head = "".join(f"<th>{_e(h)}</th>" for h in table.headers)
    body = []
    for row in table.rows:
        cells = []
        for cell in row:
            klass = f' class="{_e(cell)}"' if cell in _ANSWERS else ""
            cells.append(f"<td{klass}>{_e(cell)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


_TAGS = {"": "", "bold": "b", "code": "code", "italic": "i"}


def _spans(spans: tuple[Span, ...]) -> str:
    return "".join(
        f"<{_TAGS[style]}>{_e(text)}</{_TAGS[style]}>" if style else _e(text) for text, style in spans
    )


def _figure(path: Path, caption: str) -> str:
    return f'<figure><img src="{data_uri(path)}" alt="{_e(caption)}"><figcaption>{_e(caption)}</figcaption></figure>'


def _heading(block: Heading) -> str:
    anchor = f' id="{_e(block.anchor)}"' if block.anchor else ""
    verdict = f'<span class="{block.verdict}">{block.verdict}</span>' if block.verdict else ""
    return f"<h{block.level}{anchor}>{_e(block.text)}{verdict}</h{block.level}>"


def _block(block: Block) -> str:
    if isinstance(block, Heading):
        return _heading(block)
    if isinstance(block, Paragraph):
        return f"<p>{_spans(block.spans)}</p>"
    if isinstance(block, Bullets):
        return "<ul>" + "".join(f"<li>{_spans(item)}</li>" for item in block.items) + "</ul>"
    if isinstance(block, Figures):
        figures = "".join(_figure(f.path, f.caption or f.title) for f in block.figures)
        return f'<div class="grids">{figures}</div>' if len(block.figures) > 1 else figures
    if isinstance(block, Lead):  # the first screen: the answer beside its chart and grid
        text = "".join(_block(part) for part in block.text)
        figures = "".join(_figure(f.path, f.caption or f.title) for f in block.figures)
        return (
            f'<section id="answer" class="lead"><div class="lead-text">{text}</div>'
            f'<div class="lead-figures">{figures}</div></section>'
        )
    return table_html(block)


def render_html(report: ReportData, charts: dict[str, Path | None], grids: list[Grid]) -> str:
    body = "".join(_block(block) for block in report_blocks(report, charts, grids))
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1"><link rel="icon" href="data:,">'
        f"<title>ditq report</title><script>{CHECK_SCRIPT}</script><style>{_STYLE}</style></head>"
        f"<body>{body}</body></html>\n"
    )
