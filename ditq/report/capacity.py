"""The capacity matrix: per reference count, what a run served, at which offload, how fast, in how much memory,
how well.

Seconds per image are taken over warm requests: a server's first request of each shape (reference count,
size) is ``cold`` (compilation, autotuning, allocator warm-up) and shown apart, as ``wall_first_s``. A shape
that has no warm request contributes its cold ones, and the row says so (``includes_cold``).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from ditq.report.model import Candidate, FidelityRow, GateRow, Record, RunData

__all__ = [
    "CapacityRow",
    "FidelitySummary",
    "capacity_matrix",
    "devices_used",
    "fidelity_by_fixture",
    "max_references_served",
    "served_offloads",
    "served_parallel",
    "timed_walls",
]


@dataclass(frozen=True)
class CapacityRow:
    n_references: int
    fixtures: tuple[str, ...]
    requests: int
    served: int  # HTTP 200 with an image
    out_of_memory: int
    failed: int  # other failures (timeouts, 5xx, refused connections)
    offload: tuple[str, ...]  # the offload modes its served requests were served at (empty: not known)
    # the --parallel settings (cp=2) its served requests were served at (empty: one device)
    parallel: tuple[str, ...]
    wall_mean_s: float | None  # over warm served requests (see timed_walls)
    wall_median_s: float | None
    wall_min_s: float | None
    wall_max_s: float | None
    wall_first_s: float | None  # mean over the cold ones: each server start's first request of a shape
    includes_cold: bool  # a shape had no warm request, so its cold ones are in the statistics
    peak_memory_bytes: int | None  # the largest per-request peak the server reported
    gate_passed: int | None  # None: no gate result
    gate_total: int | None
    psnr_mean_db: float | None
    psnr_min_db: float | None
    ssim_mean: float | None
    ssim_min: float | None

    @property
    def fully_served(self) -> bool:
        return self.requests > 0 and self.served == self.requests


@dataclass(frozen=True)
class FidelitySummary:
    fixture_id: str
    n_references: int
    n: int
    psnr_mean_db: float | None
    psnr_min_db: float | None
    psnr_max_db: float | None
    ssim_mean: float | None


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def timed_walls(served: list[Record]) -> tuple[list[float], bool]:
    """The wall times s/image statistics are taken over, and whether cold ones are among them: per shape
    (reference count, size), its warm requests, or its cold ones when it has no warm request."""
    walls: list[float] = []
    includes_cold = False
    for shape in dict.fromkeys(r.shape for r in served):
        timed = [r for r in served if r.shape == shape and r.wall_s is not None]
        warm = [r for r in timed if not r.cold]
        includes_cold = includes_cold or (bool(timed) and not warm)
        walls += [r.wall_s for r in (warm or timed) if r.wall_s is not None]
    return walls, includes_cold


def _first_used(records: list[Record], setting: str) -> tuple[str, ...]:
    """The values of the served ``records``' ``setting`` attribute, in the order they were first used."""
    ordered = sorted(
        (r for r in records if r.ok and getattr(r, setting)),
        key=lambda r: (r.invocation or 0, r.t_start or 0),
    )
    return tuple(dict.fromkeys(getattr(r, setting) for r in ordered))


def served_offloads(records: list[Record]) -> tuple[str, ...]:
    """The offload modes the served ``records`` were served at, in the order they were first used."""
    return _first_used(records, "offload")


def served_parallel(records: list[Record]) -> tuple[str, ...]:
    """The --parallel settings (cp=2) the served ``records`` were served at, in the order first used."""
    return _first_used(records, "parallel")


def devices_used(records: list[Record]) -> int:
    """The most devices any served request of ``records`` was generated on (one without --parallel)."""
    return max((r.devices for r in records if r.ok), default=1)


def _row(
    n_references: int, records: list[Record], gate: list[GateRow] | None, fidelity: list[FidelityRow] | None
) -> CapacityRow:
    keys = {r.key for r in records}
    served = [r for r in records if r.ok]
    walls, includes_cold = timed_walls(served)
    first = [r.wall_s for r in served if r.cold and r.wall_s is not None]
    peaks = [r.peak_memory_bytes for r in records if r.peak_memory_bytes is not None]
    served_keys = {r.key for r in served}  # the gate judges images; failed requests are counted apart
    gate_rows = [g for g in gate if (g.fixture_id, g.seed) in served_keys] if gate is not None else None
    fid_rows = [f for f in fidelity if (f.fixture_id, f.seed) in keys] if fidelity is not None else []
    psnrs = [f.psnr_db for f in fid_rows if f.psnr_db is not None]
    ssims = [f.ssim for f in fid_rows if f.ssim is not None]
    oom = sum(1 for r in records if r.out_of_memory)
    return CapacityRow(
        n_references=n_references,
        fixtures=tuple(sorted({r.fixture_id for r in records})),
        requests=len(records),
        served=len(served),
        out_of_memory=oom,
        failed=len(records) - len(served) - oom,
        offload=served_offloads(records),
        parallel=served_parallel(records),
        wall_mean_s=_mean(walls),
        wall_median_s=_median(walls),
        wall_min_s=min(walls) if walls else None,
        wall_max_s=max(walls) if walls else None,
        wall_first_s=_mean(first),
        includes_cold=includes_cold,
        peak_memory_bytes=max(peaks) if peaks else None,
        gate_passed=None if gate_rows is None else sum(1 for g in gate_rows if g.passed),
        gate_total=None if gate_rows is None else len(gate_rows),
        psnr_mean_db=_mean(psnrs),
        psnr_min_db=min(psnrs) if psnrs else None,
        ssim_mean=_mean(ssims),
        ssim_min=min(ssims) if ssims else None,
    )


def capacity_matrix(run: RunData) -> list[CapacityRow]:
    return [_row(k, run.records_with(k), run.gate, run.fidelity) for k in run.reference_counts]


def max_references_served(candidate: Candidate) -> int:
    """The largest reference count at which every request was served (0: none)."""
    if candidate.run is None:
        return 0
    served = [row.n_references for row in capacity_matrix(candidate.run) if row.fully_served]
    return max(served, default=0)


def fidelity_by_fixture(run: RunData) -> list[FidelitySummary]:
    if run.fidelity is None:
        return []
    references = {r.fixture_id: r.n_references for r in run.records}
    out = []
    for fixture_id in sorted({f.fixture_id for f in run.fidelity}, key=lambda f: (references.get(f, 0), f)):
        rows = [f for f in run.fidelity if f.fixture_id == fixture_id]
        psnrs = [f.psnr_db for f in rows if f.psnr_db is not None]
        ssims = [f.ssim for f in rows if f.ssim is not None]
        out.append(
            FidelitySummary(
                fixture_id=fixture_id,
                n_references=references.get(fixture_id, 0),
                n=len(psnrs),
                psnr_mean_db=_mean(psnrs),
                psnr_min_db=min(psnrs) if psnrs else None,
                psnr_max_db=max(psnrs) if psnrs else None,
                ssim_mean=_mean(ssims),
            )
        )
    return out
