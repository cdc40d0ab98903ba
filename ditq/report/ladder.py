"""The offload ladder and the servers behind a candidate's numbers.

A sweep serves each candidate at the first offload mode of its ladder (``--offload none,model,block``) and
sends what ran out of memory to a server at the next one. The run's record history (every line, retried
requests included) says what each mode served and what ran out of memory there; the attempts say which
modes did not even load the model; RUN.json's invocations say what each server reported on /health
(load and ready time, kernel paths, memory budget).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from ditq.report.capacity import served_offloads, timed_walls
from ditq.report.model import Candidate, Record
from ditq.runfiles import Attempt, ServerHealth

__all__ = ["LadderRow", "ServerStart", "ladder_modes", "ladder_outcome", "offload_ladder", "server_starts"]


@dataclass(frozen=True)
class LadderRow:
    offload: str
    n_references: int | None  # None: the rung served nothing (see ``outcome``)
    requests: int
    served: int
    out_of_memory: int
    wall_median_s: float | None  # warm served requests, as the capacity matrix takes them
    peak_memory_bytes: int | None
    outcome: str | None = None  # for a rung that served nothing: "did not load (out of memory)", ...


@dataclass(frozen=True)
class ServerStart:
    """One server the candidate was served by (or that failed to load it)."""

    offload: str | None
    outcome: str  # "served", "did not load (out of memory)", "failed: ..."
    ready_s: float | None  # from starting the process to /health 200, as the sweep measured it
    health: ServerHealth | None  # what the server said on /health; None: not ditq serve, or never ready


def _history(candidate: Candidate) -> list[Record]:
    return candidate.run.history if candidate.run else []


def ladder_modes(candidate: Candidate) -> list[str]:
    """The attempts' modes in ladder order, then any other mode the records were served at."""
    modes = [a.offload for a in candidate.attempts]
    ordered = sorted(_history(candidate), key=lambda r: (r.invocation or 0, r.t_start or 0.0))
    return list(dict.fromkeys([*modes, *(r.offload for r in ordered if r.offload)]))


def _outcome(attempt: Attempt) -> str:
    if attempt.status == "out_of_memory_at_load":
        return "did not load (out of memory)"
    if not attempt.loaded:
        return f"failed: {attempt.message or 'no message'}"
    return "served" if attempt.status == "ok" else f"probe failed (exit code {attempt.exit_code})"


def _ladder_row(offload: str, n_references: int, records: list[Record]) -> LadderRow:
    served = [r for r in records if r.ok]
    walls, _ = timed_walls(served)
    peaks = [r.peak_memory_bytes for r in records if r.peak_memory_bytes is not None]
    return LadderRow(
        offload=offload,
        n_references=n_references,
        requests=len(records),
        served=len(served),
        out_of_memory=sum(1 for r in records if r.out_of_memory),
        wall_median_s=statistics.median(walls) if walls else None,
        peak_memory_bytes=max(peaks, default=None),
    )


def offload_ladder(candidate: Candidate) -> list[LadderRow]:
    """One row per offload mode x reference count, from every record line; one row for a mode that served
    nothing. Empty when nothing says an offload mode (another server, the seed's records)."""
    attempts = {a.offload: a for a in candidate.attempts}
    rows = []
    for mode in ladder_modes(candidate):
        records = [r for r in _history(candidate) if r.offload == mode]
        attempt = attempts.get(mode)
        if not records and attempt is not None and not attempt.loaded:
            rows.append(LadderRow(mode, None, 0, 0, 0, None, None, _outcome(attempt)))
        for k in sorted({r.n_references for r in records}):
            rows.append(_ladder_row(mode, k, [r for r in records if r.n_references == k]))
    return rows


def _refs(counts: list[int]) -> str:
    return f"{', '.join(str(k) for k in counts)} reference{'' if counts == [1] else 's'}"


def ladder_outcome(candidate: Candidate) -> str | None:
    """One sentence on where the ladder ended; None when there was no ladder to climb."""
    modes = ladder_modes(candidate)
    climbed = " → ".join(modes)
    if candidate.never_loaded:
        return f"The model did not load at any offload mode tried ({climbed})."
    if candidate.run is None or not modes:
        return None
    still = sorted({r.n_references for r in candidate.run.records if r.out_of_memory})
    if still:
        return f"The offload ladder ({climbed}) ended with requests still out of memory at {_refs(still)}."
    if len(modes) < 2:
        return None
    where = [
        f"{_refs([k])} at {'+'.join(served_offloads(candidate.run.records_with(k))) or 'n/a'}"
        for k in candidate.run.reference_counts
    ]
    return f"Every request was served by the end of the offload ladder ({climbed}): {'; '.join(where)}."


def server_starts(candidate: Candidate) -> list[ServerStart]:
    """Per attempt of the sweep's ladder (else per server the run talked to), what the server said."""
    servers = candidate.run.servers if candidate.run else []
    if not candidate.attempts:
        return [ServerStart(h.offload if h else None, "served", None, h) for h in servers]
    starts = []
    for attempt in candidate.attempts:
        # the last server started at this mode (a resumed sweep may have started several)
        health = next((h for h in reversed(servers) if h is not None and h.offload == attempt.offload), None)
        loaded_health = health if attempt.loaded else None
        starts.append(ServerStart(attempt.offload, _outcome(attempt), attempt.ready_s, loaded_health))
    return starts
