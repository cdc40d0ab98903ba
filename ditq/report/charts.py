"""Charts as PNG files (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from ditq.report.assess import ReportData
from ditq.report.capacity import capacity_matrix
from ditq.report.objectives import on_cpu

__all__ = ["CHARTS", "WALL_CHART", "memory_chart", "psnr_chart", "save_chart", "wall_chart", "write_charts"]

_DPI = 110


def save_chart(figure, path: Path, tight_box: bool = False) -> Path:
    """``figure`` as a PNG at ``path``, then closed; ``tight_box``: the image cropped to what is drawn (long tick
    labels stay whole)."""
    figure.tight_layout()
    figure.savefig(path, dpi=_DPI, format="png", **({"bbox_inches": "tight"} if tight_box else {}))
    plt.close(figure)
    return path


def _color(report: ReportData, name: str) -> str:
    """One colour per run across every chart: the baseline first, then the candidates in order."""
    names = [c.name for c in report.all_candidates]
    return f"C{names.index(name) % 10}"


def wall_chart(report: ReportData, path: Path) -> Path | None:
    """Seconds per image vs reference count, one line per candidate, min–max as error bars; OOM marked."""
    figure, axis = plt.subplots(figsize=(6.4, 3.8))
    plotted = False
    for candidate in report.all_candidates:
        if candidate.run is None:
            continue
        matrix = capacity_matrix(candidate.run)
        served = [r for r in matrix if r.wall_mean_s is not None]
        if served:
            ks = [r.n_references for r in served]
            means = [r.wall_mean_s or 0.0 for r in served]
            # a mean computed in floating point can sit a rounding error past the min or max: bars are never negative
            low = [max(0.0, m - (r.wall_min_s or m)) for m, r in zip(means, served, strict=True)]
            high = [max(0.0, (r.wall_max_s or m) - m) for m, r in zip(means, served, strict=True)]
            style = "--" if candidate is report.baseline else "-"
            line = axis.errorbar(
                ks,
                means,
                yerr=[low, high],
                fmt="o" + style,
                capsize=3,
                label=candidate.name,
                color=_color(report, candidate.name),
            )
            plotted = True
            top = max(means)
            for row in matrix:
                if row.out_of_memory:
                    axis.plot([row.n_references], [top], "x", markersize=10, color=line[0].get_color())
                    axis.annotate("OOM", (row.n_references, top), textcoords="offset points", xytext=(4, 4))
    if not plotted:
        plt.close(figure)
        return None
    axis.set_xlabel("reference images per request")
    axis.set_ylabel("seconds per image")
    axis.set_xticks(report.reference_counts)
    cpu = any(on_cpu(c) for c in report.all_candidates)
    axis.set_title(
        "Seconds per image" + (" (CPU: reference kernels, not a speed measurement)" if cpu else "")
    )
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    return save_chart(figure, path)


def psnr_chart(report: ReportData, path: Path) -> Path | None:
    """PSNR against BF16 per seed, one panel per fixture, the parity floor as a dashed line."""
    fixtures: list[str] = []
    for a in report.assessments:
        for row in (a.candidate.run.fidelity or []) if a.candidate.run else []:
            if row.fixture_id not in fixtures:
                fixtures.append(row.fixture_id)
    if not fixtures:
        return None
    columns = min(4, len(fixtures))
    rows = -(-len(fixtures) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(3.2 * columns, 2.8 * rows), squeeze=False)
    floors = {a.floor_db for a in report.assessments if a.floor_db is not None}
    for index, fixture in enumerate(fixtures):
        axis = axes[index // columns][index % columns]
        for a in report.assessments:
            points = [
                (f.seed, f.psnr_db)
                for f in ((a.candidate.run.fidelity or []) if a.candidate.run else [])
                if f.fixture_id == fixture and f.psnr_db is not None and f.psnr_db != float("inf")
            ]
            if points:
                points.sort()
                color = _color(report, a.candidate.name)
                axis.plot(
                    [s for s, _ in points], [p for _, p in points], "o-", label=a.candidate.name, color=color
                )
                axis.set_xticks(sorted({s for s, _ in points}))
        for floor in floors:
            axis.axhline(floor, linestyle="--", color="grey", linewidth=1)
        axis.set_title(fixture, fontsize=8)
        axis.set_xlabel("seed", fontsize=8)
        axis.set_ylabel("PSNR dB", fontsize=8)
        axis.tick_params(labelsize=7)
        axis.grid(alpha=0.3)
    for index in range(len(fixtures), rows * columns):
        axes[index // columns][index % columns].axis("off")
    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:
        figure.legend(handles, labels, fontsize=8, loc="upper right")
    return save_chart(figure, path)


def memory_chart(report: ReportData, path: Path) -> Path | None:
    """Sampled device memory over time, one line per run; None when no run sampled any (CPU)."""
    runs = [c for c in report.all_candidates if c.run and c.run.memory]
    if not runs:
        return None
    figure, axis = plt.subplots(figsize=(6.4, 3.6))
    for candidate in runs:
        assert candidate.run is not None
        samples = candidate.run.memory
        gib = [s.used_bytes / 2**30 for s in samples]
        axis.plot([s.t_s for s in samples], gib, label=candidate.name, color=_color(report, candidate.name))
    axis.set_xlabel("seconds since the run started")
    axis.set_ylabel("device memory used (GiB)")
    axis.set_title("Memory over time")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    return save_chart(figure, path)


def _stage_chart(report: ReportData, path: Path) -> Path | None:
    from ditq.report.stages import stage_memory_chart

    return stage_memory_chart(report, path)


WALL_CHART = "wall_vs_refs.png"  # the first screen's: seconds per image by reference count, every run
# file name -> (title, drawing function)
CHARTS = {
    WALL_CHART: ("Seconds per image vs reference count", wall_chart),
    "psnr_per_seed.png": ("PSNR against the baseline per seed", psnr_chart),
    "memory.png": ("Device memory over time", memory_chart),
    "memory_by_stage.png": ("Peak memory by request stage, per reference count", _stage_chart),
}


def write_charts(report: ReportData, out_dir: Path) -> dict[str, Path | None]:
    """Every chart under ``out_dir``; a chart with no data to draw maps to None."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return {name: draw(report, out_dir / name) for name, (_, draw) in CHARTS.items()}
