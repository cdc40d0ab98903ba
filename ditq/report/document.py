"""The report's layout as data: headings, paragraphs, lists, tables and figures, in reading order.

``markdown.py`` and ``html.py`` render the same blocks, so REPORT.md and report.html always say the same
things in the same order. The answer comes first: the note, then which candidate to serve, why and how sure, with
seconds per image by reference count and the worst fixture's grid beside it (the first screen); then the
verdicts with a line each on how to read them, the other charts; then the details: what was measured against, the
capacity summary, the comparison, the baseline and each candidate (facts, reasons, its plan where it has one,
capacity matrix, offload ladder, servers, stages, image grids), and the provenance.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ditq.report.assess import Assessment, ReportData
from ditq.report.charts import CHARTS, WALL_CHART
from ditq.report.grids import DIFFERENCE_SCALE, Grid
from ditq.report.ladder import ladder_outcome, offload_ladder, server_starts
from ditq.report.model import Candidate
from ditq.report.objectives import REFERENCE_KERNELS, on_cpu
from ditq.report.plan import plan_chart_name, plan_sentences, plan_table
from ditq.report.schema import IntervalEntry
from ditq.report.stages import prediction_check, stage_memory_table, stage_rows
from ditq.report.tables import (
    Table,
    capacity_summary_table,
    capacity_table,
    comparison_table,
    format_bytes,
    interval_text,
    ladder_table,
    objectives_table,
    provenance_table,
    servers_table,
    stages_table,
    step_cache_table,
    verdict_table,
)
from ditq.runfiles import ServerHealth

__all__ = [
    "Block",
    "Bullets",
    "Figure",
    "Figures",
    "Heading",
    "Lead",
    "Paragraph",
    "Span",
    "how_sure",
    "report_blocks",
]

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


@dataclass(frozen=True)
class Lead:
    """The first screen: the answer's text beside its figures (side by side in report.html, one after the other in
    REPORT.md)."""

    text: tuple[Paragraph | Bullets, ...]
    figures: tuple[Figure, ...]


Block = Heading | Paragraph | Bullets | Table | Figures | Lead


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
    if candidate.run is not None and any(r.skipped_steps is not None for r in candidate.run.records):
        yield Heading(3, "Step cache")
        yield _text(
            "Per request, the denoising steps its server served from the step cache (--cache; the server's "
            "transformer calls whose blocks the cache skipped), out of the steps it ran."
        )
        yield step_cache_table(candidate)
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
            f"{grid.fixture_id}: {report.baseline.name} | {grid.candidate} | {DIFFERENCE_SCALE}; "
            f"seeds {', '.join(str(s) for s in grid.seeds)}",
        )
        for grid in grids
        if grid.candidate == candidate.name and not grid.lead
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


def _context(report: ReportData) -> Paragraph:
    """What the numbers were measured against: the baseline, the memory budget, compilation, when."""
    document = report.document
    return Paragraph(
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


def _capacity(report: ReportData) -> Iterator[Block]:
    yield Heading(2, "Capacity")
    yield _text(
        "Per reference count: the offload mode the requests were served at, the median seconds per image "
        "(a server's first request of each shape left out) and the peak memory. OOM: out of memory at every "
        "offload mode tried."
    )
    yield capacity_summary_table(report)


# How to read the answers and their intervals (said once, under the verdicts), a line each.
READING = (
    "YES or NO only where a 95% bootstrap interval (over seeds for fidelity, over requests for speed) decides it; "
    "UNDECIDED says what settles it.",
    "Fit to serve: no failed stage or doctor check, every request served within the memory budget, no collapse, "
    "and every fixture's fidelity decided: visually lossless (mean PSNR and SSIM against the baseline above their "
    "thresholds) or, the stricter or looser parity band, as close as a second acceptable run of the model.",
    "Faster: the candidate's seconds per image as a multiple of the baseline's (below 1 is faster) at every "
    "reference count both served, beyond a 5% tolerance. Timed on a CPU: reference kernels, not a speed "
    "measurement, so not answered. Smaller: fewer weight bytes, and a peak no larger.",
)


def _assessment(report: ReportData, name: str | None) -> Assessment | None:
    return next((a for a in report.assessments if a.candidate.name == name), None)


def how_sure(report: ReportData) -> str:
    """The answer's certainty in one sentence: for the candidate to serve, how many fixtures and seeds decided it
    and the closest call; for none, the first candidate's open question."""
    chosen = _assessment(report, report.document.recommendation.candidate)
    if chosen is None:
        undecided = next(
            (a for a in report.assessments if a.objectives.fit_to_serve.answer == "UNDECIDED"), None
        )
        if undecided is None:
            return "How sure: every candidate was decided unfit by the reasons below."
        fit = undecided.objectives.fit_to_serve
        settle = f" To settle it: {fit.settle_command}" if fit.settle_command else ""
        return f"How sure: {undecided.candidate.name} is UNDECIDED ({fit.reasons[0].message.rstrip('.')}).{settle}"
    intervals = [e for e in chosen.objectives.fit_to_serve.intervals if e.low is not None]
    if not intervals:
        return "How sure: fit to serve on its checks; no fidelity interval was measured."
    seeds = max(e.n or 0 for e in intervals)
    closest = min(intervals, key=_margin_db)
    fixtures = {e.subject.split(" (")[0] for e in intervals}
    return (
        f"How sure: each of {len(fixtures)} fixture(s) decided on a 95% interval over up to {seeds} seeds; the "
        f"closest, {closest.subject}: {interval_text(closest)} against {closest.threshold}."
    )


def _margin_db(entry: IntervalEntry) -> float:
    """How far an interval's low end clears its threshold ('at least 40 dB', 'at least 0.98', 'floor -1 dB'), in
    dB for every measure: PSNR's and the parity band's as they are, SSIM's as 10 log10 of the ratio of 1 - SSIM
    at the threshold to 1 - SSIM at the low end, so that the closest call is found across measures."""
    numbers = re.findall(r"[-+]?\d+(?:\.\d+)?", entry.threshold)
    threshold, low = (float(numbers[0]) if numbers else 0.0), entry.low or 0.0
    if entry.measure == "ssim":
        return 10 * math.log10(max(1 - threshold, 1e-9) / max(1 - low, 1e-9))
    return low - threshold


def _lead(report: ReportData, charts: dict[str, Path | None], grids: list[Grid]) -> Iterator[Block]:
    """The first screen: which candidate to serve and why, how sure, the others in a line each; beside them the
    seconds per image by reference count and the worst fixture's grid."""
    recommendation = report.document.recommendation
    text: list[Paragraph | Bullets] = [Paragraph(((recommendation.why, "bold"),)), _text(how_sure(report))]
    if any(on_cpu(c) for c in report.all_candidates):
        text.append(Paragraph((("Timed on a CPU: ", "bold"), (f"{REFERENCE_KERNELS}.", ""))))
    if recommendation.others:
        text.append(
            Bullets(tuple(((n, "bold"), (f": {why}", "")) for n, why in recommendation.others.items()))
        )
    figures = []
    chart = charts.get(WALL_CHART)
    if chart is not None:
        figures.append(Figure(chart, CHARTS[WALL_CHART][0], None))
    lead = next((g for g in grids if g.lead), None)
    if lead is not None:
        caption = (
            f"Worst fixture, {lead.fixture_id}, seed {lead.seeds[0]}: {report.baseline.name} | {lead.candidate} | "
            f"{DIFFERENCE_SCALE}"
        )
        figures.append(Figure(lead.path, f"{lead.candidate} {lead.fixture_id}", caption))
    yield Heading(2, "Which candidate to serve")
    yield Lead(tuple(text), tuple(figures))


def report_blocks(report: ReportData, charts: dict[str, Path | None], grids: list[Grid]) -> list[Block]:
    """First the answer (``_lead``), then the objectives and the charts, then the details: the capacity, the
    comparison, the baseline and each candidate, the provenance."""
    base = report.baseline
    blocks: list[Block] = [Heading(1, "ditq report")]
    if report.document.note:
        blocks.append(Paragraph((("Note:", "bold"), (f" {report.document.note}", ""))))
    blocks += [
        *_lead(report, charts, grids),
        Heading(2, "Verdicts"),
        verdict_table(report),
        Bullets(tuple(((line, ""),) for line in READING)),
        Heading(2, "Charts"),
    ]
    for name, (title, _) in CHARTS.items():
        path = charts.get(name)
        if name == WALL_CHART:
            continue  # on the first screen
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
    blocks += [Heading(2, "Details"), _context(report), *_capacity(report)]
    blocks += [
        Heading(2, f"Comparison with {base.name} and between candidates"),
        _text(
            "Seconds per image by reference count (mean / median of warm requests); (N× the baseline's time) "
            "is the candidate's mean over the baseline's at the same count: below 1 is faster."
            + (
                f" Timed on a CPU: {REFERENCE_KERNELS}."
                if any(on_cpu(c) for c in report.all_candidates)
                else ""
            )
        ),
        comparison_table(report),
        Heading(2, f"{base.name} (baseline)"),
    ]
    facts = _facts(base, None, report)
    blocks += [_sentence(facts)] if facts else []
    blocks += [Heading(3, "Capacity matrix"), capacity_table(report.baseline_matrix), *_serving(base)]
    for a in report.assessments:
        blocks += _candidate(a, report, grids, charts)
    return [*blocks, Heading(2, "Provenance"), provenance_table(report)]
