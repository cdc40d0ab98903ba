"""Where memory goes, request stage by request stage, and how well the server's cost model predicted each peak.

A ditq server on CUDA reports, per request, the allocator's peak in each stage (text encoding, image encoding,
the first denoising step, which fills a prefix KV cache where the pipeline keeps one, the later steps, decoding,
and the work between them), what it held when the request began (the resident weights), and the peak its cost
model predicted before the request ran. Per offload mode and reference count, the medians of the warm requests
make one row; the chart stacks each stage's addition on what was held at the start.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from ditq.report.assess import ReportData
from ditq.report.model import Candidate, Record
from ditq.report.tables import Table, format_bytes

__all__ = [
    "STAGE_ORDER",
    "PredictionCheck",
    "StageRow",
    "prediction_check",
    "stage_memory_chart",
    "stage_memory_table",
    "stage_rows",
]

# Stages in the order a request runs them (the stage clock's names).
STAGE_ORDER = ("text_encoding", "image_encoding", "first_step", "later_steps", "decoding", "other")


@dataclass(frozen=True)
class StageRow:
    """One offload mode and reference count: medians over the warm requests that reported stage memory."""

    offload: str | None
    n_references: int
    requests: int
    start_bytes: int
    stage_peaks: dict[str, int]  # stage -> peak allocated bytes (resident weights included)
    peak_bytes: int
    predicted_peak_bytes: int | None
    error: float | None  # predicted / measured - 1 (median over the requests)


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def _reporting(candidate: Candidate) -> list[Record]:
    """Every served request line with stage memory, retried ones included (each ran on its own server)."""
    run = candidate.run
    if run is None:
        return []
    return [r for r in run.history if r.ok and r.stage_peaks and r.start_bytes is not None]


def stage_rows(candidate: Candidate) -> list[StageRow]:
    records = _reporting(candidate)
    warm = [r for r in records if not r.cold] or records
    groups: dict[tuple[str | None, int], list[Record]] = {}
    for record in warm:
        groups.setdefault((record.offload, record.n_references), []).append(record)
    rows = []
    for (offload, count), group in sorted(groups.items(), key=lambda item: (str(item[0][0]), item[0][1])):
        stages = sorted({s for r in group for s in r.stage_peaks or {}}, key=_stage_rank)
        predicted = [r.predicted_peak_bytes for r in group if r.predicted_peak_bytes is not None]
        errors = [
            r.predicted_peak_bytes / r.measured_peak_bytes - 1
            for r in group
            if r.predicted_peak_bytes is not None and r.measured_peak_bytes
        ]
        rows.append(
            StageRow(
                offload=offload,
                n_references=count,
                requests=len(group),
                start_bytes=int(_median([r.start_bytes or 0 for r in group])),
                stage_peaks={
                    s: int(
                        _median(
                            [(r.stage_peaks or {}).get(s, 0) for r in group if s in (r.stage_peaks or {})]
                        )
                    )
                    for s in stages
                },
                peak_bytes=int(_median([r.measured_peak_bytes or 0 for r in group])),
                predicted_peak_bytes=int(_median(predicted)) if predicted else None,
                error=_median(errors) if errors else None,
            )
        )
    return rows


def _stage_rank(stage: str) -> int:
    return STAGE_ORDER.index(stage) if stage in STAGE_ORDER else len(STAGE_ORDER)


@dataclass(frozen=True)
class PredictionCheck:
    """The cost model's predicted peak against the measured one, over every request that reported both."""

    requests: int
    worst_error: float  # the largest |predicted / measured - 1|
    worst: str  # which request: "edit-4ref s2301 (4 refs, offload auto)"


def prediction_check(candidate: Candidate) -> PredictionCheck | None:
    checked = [
        r for r in _reporting(candidate) if r.predicted_peak_bytes is not None and r.measured_peak_bytes
    ]
    if not checked:
        return None

    def error(record: Record) -> float:
        assert record.predicted_peak_bytes is not None and record.measured_peak_bytes
        return abs(record.predicted_peak_bytes / record.measured_peak_bytes - 1)

    worst = max(checked, key=error)
    where = f"{worst.fixture_id} s{worst.seed} ({worst.n_references} refs, offload {worst.offload or 'n/a'})"
    return PredictionCheck(len(checked), error(worst), where)


def stage_memory_chart(report: ReportData, path: Path) -> Path | None:
    """Per candidate, per reference count: one bar per stage, the resident weights at the bottom and the stage's
    addition on top (peak allocated GiB). None when no run reported stage memory (CPU servers)."""
    panels = [(c, rows) for c in report.all_candidates if (rows := stage_rows(c))]
    if not panels:
        return None
    figure, axes = plt.subplots(len(panels), 1, figsize=(8.0, 2.9 * len(panels)), squeeze=False)
    colors = {stage: f"C{i}" for i, stage in enumerate(STAGE_ORDER)}
    for (candidate, rows), axis in zip(panels, axes[:, 0], strict=True):
        stages = [s for s in STAGE_ORDER if any(s in r.stage_peaks for r in rows)]
        width = 0.8 / max(1, len(stages))
        for position, row in enumerate(rows):
            start = row.start_bytes / 2**30
            for index, stage in enumerate(stages):
                if stage not in row.stage_peaks:
                    continue
                x = position + (index - (len(stages) - 1) / 2) * width
                added = max(0.0, row.stage_peaks[stage] / 2**30 - start)
                axis.bar(x, start, width, color="lightgrey", edgecolor="grey", linewidth=0.5)
                label = stage if position == 0 else None
                axis.bar(x, added, width, bottom=start, color=colors[stage], label=label)
            if row.predicted_peak_bytes is not None:
                axis.plot(
                    [position - 0.45, position + 0.45], [row.predicted_peak_bytes / 2**30] * 2, "k--", lw=1
                )
        axis.set_xticks(range(len(rows)))
        axis.set_xticklabels([f"{r.n_references} refs\n{r.offload or ''}" for r in rows], fontsize=7)
        axis.set_ylabel("peak allocated GiB", fontsize=8)
        axis.set_title(
            f"{candidate.name}: held at the start (grey) + each stage (dashed: predicted peak)", fontsize=8
        )
        axis.grid(alpha=0.3, axis="y")
        axis.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    figure.tight_layout()
    figure.savefig(path, dpi=110, format="png")
    plt.close(figure)
    return path


def stage_memory_table(candidate: Candidate) -> Table:
    """Offload x reference count: held at the start, each stage's peak, the measured and predicted peaks."""
    rows = stage_rows(candidate)
    stages = [s for s in STAGE_ORDER if any(s in r.stage_peaks for r in rows)]
    body = tuple(
        (
            row.offload or "n/a",
            str(row.n_references),
            str(row.requests),
            format_bytes(row.start_bytes),
            *(format_bytes(row.stage_peaks.get(s)) if s in row.stage_peaks else "—" for s in stages),
            format_bytes(row.peak_bytes),
            format_bytes(row.predicted_peak_bytes),
            "n/a" if row.error is None else f"{row.error * 100:+.1f} %",
        )
        for row in rows
    )
    headers = ("Offload", "Refs", "Requests", "Held at start", *stages, "Peak", "Predicted", "Error")
    return Table(headers, body)
