"""The report's layout as data: headings, paragraphs, lists, tables and figures, in reading order.

``markdown.py`` and ``html.py`` render the same blocks, so REPORT.md and report.html always say the same
things in the same order: the note, the capacity summary, the verdicts, the comparison, the baseline and
each candidate (facts, reasons, its plan where it has one, capacity matrix, offload ladder, servers, stages,
image grids), the charts and the provenance.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ditq.report.assess import Assessment, ReportData
from ditq.report.charts import CHARTS
from ditq.report.grids import Grid
from ditq.report.ladder import ladder_outcome, offload_ladder, server_starts
from ditq.report.model import Candidate
from ditq.report.plan import plan_chart_name, plan_sentences, plan_table
from ditq.report.stages import prediction_check, stage_memory_table, stage_rows
from ditq.report.tables import (
    Table,
    capacity_summary_table,
    capacity_table,
    comparison_table,
    format_bytes,
    ladder_table,
    objectives_table,
    provenance_table,
    servers_table,
    stages_table,
    verdict_table,
)
from ditq.runfiles import ServerHealth

__all__ = ["Block", "Bullets", "Figure", "Figures", "Heading", "Paragraph", "Span", "report_blocks"]

Style = Literal["", "bold", "code", "italic"]
Span = tuple[str, Style]


@dataclass(frozen=True)
class Heading:
    level: int
    text: str
    verdict: str | None = None  # "YES" | "NO", shown after the text
    anchor: str | None = None


@dataclass(frozen=True)
class Paragraph:
    spans: tuple[Span, ...]


@dataclass(frozen=True)
class Bullets:
    items: tuple[tuple[Span, ...], ...]


@dataclass(frozen=True)
class Figure:
    path: Path
    title: str
    caption: str | None  # shown under the image; None: the title says it


@dataclass(frozen=True)
class Figures:
    figures: tuple[Figure, ...]


Block = Heading | Paragraph | Bullets | Table | Figures


def _text(text: str) -> Paragraph:
    return Paragraph(((text, ""),))


def _facts(candidate: Candidate, assessment: Assessment | None, report: ReportData) -> list[tuple[Span, ...]]:
    """The candidate's facts: scheme, digest, parity floor, endpoint, budget, weights, what peaks measure."""
    parts: list[tuple[Span, ...]] = []
    if assessment is not None:
        parts.append((("scheme ", ""), (candidate.scheme or "n/a", "code")))
        parts.append((("artifact digest ", ""), (candidate.artifact_digest or "n/a", "code")))
        if assessment.floor_db is not None:
            parts.append(((f"parity floor {assessment.floor_db:.2f} dB", ""),))
    if candidate.endpoint:
        parts.append((("probed through ", ""), (candidate.endpoint, "code")))
    if candidate.memory_budget:
        parts.append(((f"memory budget {candidate.memory_budget}", ""),))
    facts = (_weights(candidate, report), _memory_measure(candidate))
    return parts + [((fact, ""),) for fact in facts if fact]


def _memory_measure(candidate: Candidate) -> str | None:
    description = candidate.run.memory_description if candidate.run else None
    if description is not None and description.source == "unavailable":
        return "device memory was not sampled (no NVML or nvidia-smi)"
    if description is not None and description.measures is not None:
        return f"peak memory measures the {description.measures} ({description.source})"
    return None


def _sentence(parts: list[tuple[Span, ...]]) -> Paragraph:
    """Parts joined by semicolons into one sentence, starting with a capital."""
    separator: tuple[Span, ...] = (("; ", ""),)
    spans: list[Span] = [
        span for index, part in enumerate(parts) for span in (separator if index else ()) + part
    ]
    text, style = spans[0]
    return Paragraph(((text[:1].upper() + text[1:], style), *spans[1:], (".", "")))


def _weights(candidate: Candidate, report: ReportData) -> str | None:
    if candidate.weight_bytes:
        ours = sum(w.artifact for w in candidate.weight_bytes.values())
        source = sum(w.source for w in candidate.weight_bytes.values())
        names = ", ".join(candidate.weight_bytes)
        return (
            f"{names} weights {format_bytes(ours)} ({ours / source:.2f}× the source's {format_bytes(source)})"
        )
    if candidate is report.baseline and report.baseline_profile.weight_bytes is not None:
        weights = format_bytes(report.baseline_profile.weight_bytes)
        return f"the components the candidates quantize weigh {weights} in the source model"
    return None


def _serving(candidate: Candidate) -> Iterator[Block]:
    """The capacity matrix's companions: the offload ladder and the servers behind the numbers."""
    if offload_ladder(candidate):
        yield Heading(3, "Offload ladder")
        yield _text(
            "Every request line of the run, by the offload mode its server ran at (requests that ran out of "
            "memory at one mode were sent to the next)."
        )
        yield ladder_table(candidate)
    outcome = ladder_outcome(candidate)
    if outcome:
        yield _text(outcome)
    starts = server_starts(candidate)
    if any(s.health is not None or s.outcome != "served" for s in starts):
        yield Heading(3, "Servers")
        yield _text(
            "Start to ready: from starting the server to /health 200, as the sweep measured it. Load, kernel "
            "choice and load + doctor: as the server reported them; kernel choice is the part of the load the "
            "doctor's checks took while choosing each layer's path, kernel compilation included."
        )
        yield servers_table(candidate)
    if stage_rows(candidate):
        yield Heading(3, "Memory by stage")
        yield _text(
            "Peak allocated memory of each request stage (the resident weights included), the medians of the "
            "warm requests per offload mode and reference count, as the server measured them; predicted: the "
            "peak the server's cost model gave the request before it ran."
        )
        yield stage_memory_table(candidate)
        check = prediction_check(candidate)
        if check is not None:
            yield _text(
                f"The predicted peak was within {check.worst_error * 100:.1f} % of the measured one for every one "
                f"of the {check.requests} requests that reported both (the farthest: {check.worst})."
            )


def _plan(candidate: Candidate, charts: dict[str, Path | None]) -> Iterator[Block]:
    """A planned candidate's plan: what it is, how it was checked, the sensitivity chart, what was not fastest."""
    if candidate.plan is None:
        return
    yield Heading(3, "Plan")
    yield Bullets(tuple(((line, ""),) for line in plan_sentences(candidate.plan)))
    chart = charts.get(plan_chart_name(candidate.name))
    if chart is not None:
        yield Figures((Figure(chart, f"{candidate.name} per-layer sensitivity", None),))
    table = plan_table(candidate.plan)
    if table.rows:
        yield _text(
            f"Layers not at {candidate.plan.schemes[0]} (slower scheme or kept), most sensitive first:"
        )
        yield table


def _candidate(
    a: Assessment, report: ReportData, grids: list[Grid], charts: dict[str, Path | None]
) -> Iterator[Block]:
    candidate = a.candidate
    yield Heading(2, f"{candidate.name}: ", a.verdict, candidate.name)
    facts = _facts(candidate, a, report)
    if facts:
        yield _sentence(facts)
    reasons = [
        r for name in ("fit_to_serve", "faster", "smaller") for r in getattr(a.objectives, name).reasons
    ]
    other = [s for s in a.objectives.fit_by_standard if s != report.document.standard]
    reasons += [r for s in other for r in a.objectives.fit_by_standard[s].reasons if r not in reasons]
    yield Bullets(
        tuple(((r.code, "bold"), (f": {r.message}", "")) for r in reasons)
        or ((("Every check passed.", ""),),)
    )
    yield from _plan(candidate, charts)
    yield Heading(3, "Objectives")
    yield objectives_table(a)
    if a.matrix:
        yield Heading(3, "Capacity matrix")
        yield capacity_table(a.matrix)
    yield from _serving(candidate)
    if candidate.stages:
        yield Heading(3, "Stages")
        yield stages_table(candidate)
    figures = tuple(
        Figure(
            grid.path,
            f"{grid.candidate} {grid.fixture_id}",
            f"{grid.fixture_id}: {report.baseline.name} | {grid.candidate} | amplified difference, "
            f"seeds {', '.join(str(s) for s in grid.seeds)}",
        )
        for grid in grids
        if grid.candidate == candidate.name
    )
    if figures:
        yield Figures(figures)


_NOT_COMPILED = "not compiled"


def compilation_sentence(servers: dict[str, list[ServerHealth | None]]) -> str:
    """Whether the servers behind the speeds (per candidate, the baseline first) ran compiled: every speed answer
    compares like with like only when the baseline and the candidates agree. A server that compiled is named by its
    backend (``eager`` is one of torch.compile's too), one that did not as ``not compiled``."""
    modes: dict[str, set[str]] = {}
    for name, healths in servers.items():
        for health in healths:
            if health is not None:
                modes.setdefault(name, set()).add(health.compile.backend if health.compile else _NOT_COMPILED)
    if not modes:
        return "Compilation: not reported by the servers."
    kinds = set().union(*modes.values())
    if len(kinds) == 1:
        (kind,) = kinds
        how = "eager (not compiled)" if kind == _NOT_COMPILED else f"compiled (torch.compile, {kind} backend)"
        return f"Every server, the baseline's included, ran {how}."
    per = "; ".join(f"{name} {', '.join(sorted(kinds))}" for name, kinds in modes.items())
    return f"Servers ran compiled and not ({per}): their speeds do not compare like with like."


def _servers(report: ReportData) -> dict[str, list[ServerHealth | None]]:
    return {c.name: c.run.servers if c.run else [] for c in report.all_candidates}


def _head(report: ReportData) -> Iterator[Block]:
    document = report.document
    yield Heading(1, "ditq report")
    if document.note:
        yield Paragraph((("Note:", "bold"), (f" {document.note}", "")))
    yield Paragraph(
        (
            ("Baseline: ", ""),
            (report.baseline.name, "bold"),
            (" (", ""),
            (document.baseline.run, "code"),
            ("). Memory budget: ", ""),
            (document.memory_budget or "the whole device", "bold"),
            (f". {compilation_sentence(_servers(report))} Generated {document.generated_utc}.", ""),
        )
    )
    yield Heading(2, "Capacity")
    yield _text(
        "Per reference count: the offload mode the requests were served at, the median seconds per image "
        "(a server's first request of each shape left out) and the peak memory. OOM: out of memory at every "
        "offload mode tried."
    )
    yield capacity_summary_table(report)


# How to read the answers and their intervals (said once, above the verdicts).
READING = (
    "Each candidate answers three questions apart: fit to serve (no failed stage or doctor check, every request "
    "served within the memory budget, no collapse, and every fixture's fidelity decided inside a standard), "
    "faster (at every reference count both served) and smaller (weights, and peak memory no larger). Fit to "
    "serve is answered under two fidelity standards: visually lossless (each fixture's mean PSNR and mean SSIM "
    "against the baseline above stated thresholds) and the parity band (as close to the baseline as a second "
    "acceptable run of the model is, which can be far stricter or far looser than what a viewer sees). The "
    "verdict column is the objective chosen with --objective, under the standard chosen with --standard. An "
    "answer is YES or NO only when its intervals decide it; UNDECIDED means the evidence so far cannot tell, "
    "and the command that settles it is given. An interval [low, high] is a 95% bootstrap interval over seeds: "
    "for the lossless standard it is the mean PSNR (or SSIM) and a fixture passes when the whole interval lies "
    "above the threshold; for the parity band it is the candidate's PSNR minus the reference pair's, seed by "
    "seed, and a fixture is inside when the whole interval lies above the floor (minus the tolerance), outside "
    "when it lies wholly below; for speed it is the candidate's seconds per image over the baseline's, faster "
    "when the whole interval lies below 1 minus the tolerance, slower when above 1 plus it."
)


def report_blocks(report: ReportData, charts: dict[str, Path | None], grids: list[Grid]) -> list[Block]:
    base = report.baseline
    recommendation = report.document.recommendation
    blocks: list[Block] = [
        *_head(report),
        Heading(2, "Which candidate to serve"),
        Paragraph(((recommendation.why, "bold"),)),
        Bullets(tuple(((name, "bold"), (f": {why}", "")) for name, why in recommendation.others.items())),
        Heading(2, "Verdicts"),
        _text(READING),
        verdict_table(report),
    ]
    blocks += [
        Heading(2, f"Comparison with {base.name} and between candidates"),
        _text(
            "Seconds per image by reference count (mean / median of warm requests); (N× the baseline's time) "
            "is the candidate's mean over the baseline's at the same count: below 1 is faster."
        ),
        comparison_table(report),
        Heading(2, f"{base.name} (baseline)"),
    ]
    facts = _facts(base, None, report)
    blocks += [_sentence(facts)] if facts else []
    blocks += [Heading(3, "Capacity matrix"), capacity_table(report.baseline_matrix), *_serving(base)]
    for a in report.assessments:
        blocks += _candidate(a, report, grids, charts)
    blocks.append(Heading(2, "Charts"))
    for name, (title, _) in CHARTS.items():
        path = charts.get(name)
        blocks.append(
            Figures((Figure(path, title, None),))
            if path is not None
            else Paragraph(
                (
                    (
                        f"{title}: nothing to draw (no run has these numbers; memory is sampled on GPUs only).",
                        "italic",
                    ),
                )
            )
        )
    return [*blocks, Heading(2, "Provenance"), provenance_table(report)]
