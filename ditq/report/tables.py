"""The report's tables as data (headers + cells as text), rendered alike by markdown.py and html.py."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ditq.report.assess import ReportData
from ditq.report.capacity import CapacityRow
from ditq.report.model import Candidate

__all__ = [
    "Table",
    "capacity_table",
    "comparison_table",
    "format_bytes",
    "provenance_table",
    "stages_table",
    "verdict_table",
]


@dataclass(frozen=True)
class Table:
    headers: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]


def format_bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.0f} MiB"


def _num(value: float | None, digits: int = 2, unit: str = "") -> str:
    if value is None:
        return "n/a"
    if math.isinf(value):
        return "∞ (identical)"
    return f"{value:.{digits}f}{unit}"


def _served(row: CapacityRow) -> str:
    text = f"{row.served}/{row.requests}"
    if row.out_of_memory:
        text += f" ({row.out_of_memory} OOM)"
    if row.failed:
        text += f" ({row.failed} failed)"
    return text


def _wall(row: CapacityRow) -> str:
    if row.wall_mean_s is None:
        return "OOM" if row.out_of_memory else "n/a"
    return f"{row.wall_mean_s:.2f} ({row.wall_min_s:.2f}–{row.wall_max_s:.2f})"


def capacity_table(matrix: list[CapacityRow]) -> Table:
    rows = tuple(
        (
            str(row.n_references),
            ", ".join(row.fixtures),
            _served(row),
            _wall(row),
            format_bytes(row.peak_memory_bytes),
            "not run" if row.gate_total is None else f"{row.gate_passed}/{row.gate_total}",
            f"{_num(row.psnr_mean_db)} / {_num(row.psnr_min_db)}",
            f"{_num(row.ssim_mean, 3)} / {_num(row.ssim_min, 3)}",
        )
        for row in matrix
    )
    headers = (
        "Refs",
        "Fixtures",
        "Served",
        "Wall s mean (min–max)",
        "Peak memory",
        "Gate passes",
        "PSNR dB mean / min",
        "SSIM mean / min",
    )
    return Table(headers, rows)


def verdict_table(report: ReportData) -> Table:
    rows = []
    for a in report.assessments:
        profile = a.profile
        seconds = ", ".join(f"{k}: {v:.2f}" for k, v in profile.seconds_per_image.items()) or "n/a"
        rows.append(
            (
                a.candidate.name,
                a.verdict,
                str(profile.max_references_served),
                seconds,
                format_bytes(profile.peak_memory_bytes),
                " ".join(r.message for r in a.reasons) or "Every check passed.",
            )
        )
    headers = ("Candidate", "Verdict", "Max refs served", "s/image by refs", "Peak memory", "Reasons")
    return Table(headers, tuple(rows))


def _cell(row: CapacityRow | None, baseline: CapacityRow | None) -> str:
    if row is None:
        return "—"
    if row.wall_mean_s is None:
        return "OOM" if row.out_of_memory else "failed"
    text = f"{row.wall_mean_s:.2f} s"
    if baseline is not None and baseline.wall_mean_s:
        text += f" (×{baseline.wall_mean_s / row.wall_mean_s:.2f})"
    elif baseline is not None and baseline.out_of_memory:
        text += " (baseline OOM)"
    return text


def comparison_table(report: ReportData) -> Table:
    """One row per candidate (BF16 first): seconds per image by reference count, speed-up vs BF16."""
    counts = report.reference_counts
    base = {row.n_references: row for row in report.baseline_matrix}
    entries: list[tuple[Candidate, list[CapacityRow], str]] = [
        (report.baseline, report.baseline_matrix, "baseline")
    ]
    entries += [(a.candidate, a.matrix, a.verdict) for a in report.assessments]
    rows = []
    for candidate, matrix, verdict in entries:
        by_k = {row.n_references: row for row in matrix}
        is_base = candidate is report.baseline
        gate = [(r.gate_passed or 0, r.gate_total) for r in matrix if r.gate_total is not None]
        psnr = [r.psnr_mean_db for r in matrix if r.psnr_mean_db is not None]
        rows.append(
            (
                candidate.name,
                *(_cell(by_k.get(k), None if is_base else base.get(k)) for k in counts),
                format_bytes(candidate.run.peak_memory_bytes if candidate.run else None),
                f"{sum(p for p, _ in gate)}/{sum(t or 0 for _, t in gate)}" if gate else "not run",
                "reference" if is_base else _num(min(psnr) if psnr else None),
                verdict,
            )
        )
    headers = ("Row", *(f"{k} refs" for k in counts), "Peak memory", "Gate", "Lowest PSNR dB", "Verdict")
    return Table(headers, tuple(rows))


def stages_table(candidate: Candidate) -> Table:
    rows = tuple(
        (
            s.name,
            s.status,
            _num(s.seconds, 1, " s"),
            s.message or "",
            s.command or "",
        )
        for s in candidate.stages
    )
    return Table(("Stage", "Status", "Time", "Message", "Command"), rows)


def provenance_table(report: ReportData) -> Table:
    p = report.document.provenance
    rows: list[tuple[str, str]] = [
        ("ditq", f"{p.ditq_version} ({p.git_revision or 'not a git checkout'})"),
        ("device (report)", p.device),
        ("python / platform", f"{p.python} / {p.platform}"),
        ("libraries", ", ".join(f"{k} {v}" for k, v in p.libraries.items())),
        ("memory budget", report.document.memory_budget or "whole device"),
        ("report command", p.report_command),
    ]
    for name, commands in p.run_commands.items():
        rows.extend((f"{name} command", command) for command in commands)
    for candidate in report.all_candidates:
        if candidate.run and candidate.run.run_json.get("device"):
            rows.append((f"{candidate.name} device", str(candidate.run.run_json["device"])))
    return Table(("What", "Value"), tuple(rows))
