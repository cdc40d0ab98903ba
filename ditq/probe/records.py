"""Run records: one ``ProbeRecord`` per request, appended to records.jsonl and fsynced as each completes.

The key of a record is (fixture_id, seed); when a key was retried, the last line wins, and the earlier lines
stay as history. The seed probe's layout (``matrix*.json`` lists, ``matrix/`` images) is read too: its
records are turned into ``ProbeRecord`` here, by ``SeedRecord``, and nowhere else.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from ditq.errors import DitqError, InputError
from ditq.fsutil import file_kind
from ditq.jsonfile import JsonRefused, NotJson, loads, read_bounded
from ditq.runfiles import (
    IMAGES_DIR,
    RECORDS_FILE,
    RUN_FILE,
    ProbeRecord,
    RunDescription,
    RunFile,
    Structure,
    parse,
    read_json,
    read_model,
    to_json,
)

__all__ = [
    "RecordLog",
    "SeedRecord",
    "changed_fixtures",
    "find_image",
    "image_name",
    "incomplete",
    "is_out_of_memory",
    "is_success",
    "latest_by_key",
    "read_records",
    "read_run_file",
    "require_complete",
    "unrecorded",
]

log = logging.getLogger(__name__)

_SEED_IMAGES_DIR = "matrix"
_OOM = re.compile(r"out[ _-]of[ _-]memory|\boom\b", re.IGNORECASE)


def image_name(fixture_id: str, seed: int) -> str:
    return f"{fixture_id}.s{seed}.png"


def is_success(record: ProbeRecord) -> bool:
    """An image came back (over HTTP 200, or in process where ``http`` is null) and nothing failed."""
    return record.http in (200, None) and bool(record.sha256) and not record.error


OUT_OF_MEMORY_CODES = frozenset({"out_of_memory", "over_memory_budget"})


def is_out_of_memory(record: ProbeRecord) -> bool:
    """The request did not fit the server's memory: it ran out (503 ``out_of_memory``) or was refused before
    it ran because its lower bound could never fit (413 ``over_memory_budget``)."""
    return record.error_code in OUT_OF_MEMORY_CODES


class RecordLog:
    """Append-only records.jsonl, one line per record, each fsynced.

    On open, a last line without its newline is made whole or cut: kept (the newline added) when it is a whole
    JSON line, as ``read_records`` counts it; cut when a kill tore it. An append that cannot be written (a full
    disk) is taken back, so no half line is left for the next append to follow, and the log takes no more.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._repair()
        self._handle = open(self.path, "ab", buffering=0)  # noqa: SIM115 - held for the run
        self._failed: str | None = None  # why an append could not be written

    def _repair(self) -> None:
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        if not data or data.endswith(b"\n"):
            return
        keep = data.rfind(b"\n") + 1
        try:
            loads(data[keep:])
        except NotJson:
            log.warning(
                "%s: dropping a torn last line (%d bytes) left by an interrupted run",
                self.path,
                len(data) - keep,
            )
            with open(self.path, "r+b") as handle:
                handle.truncate(keep)
            return
        except JsonRefused:
            pass  # whole, but not a record ditq reads: reading the records names it
        with open(self.path, "ab") as handle:  # a whole record whose newline was not written
            handle.write(b"\n")

    def append(self, record: ProbeRecord) -> None:
        """Write one line; a write error is a DitqError naming the file (ValueError once closed)."""
        line = (json.dumps(to_json(record)) + "\n").encode()
        with self._lock:
            if self._handle.closed:
                raise ValueError(f"{self.path}: the record log is closed")
            if self._failed is not None:
                raise DitqError(f"{self.path}: an earlier record could not be written ({self._failed})")
            size = os.fstat(self._handle.fileno()).st_size
            try:
                written = 0
                while written < len(line):
                    written += self._handle.write(line[written:]) or 0
                os.fsync(self._handle.fileno())
            except OSError as error:
                self._failed = error.strerror or str(error)
                with contextlib.suppress(OSError):
                    os.ftruncate(self._handle.fileno(), size)
                raise DitqError(f"{self.path}: cannot write a record ({self._failed})") from error

    def close(self) -> None:
        with self._lock:
            self._handle.close()

    def __enter__(self) -> RecordLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SeedRecord(BaseModel):
    """A record of the seed probe (``seed/probe-issue-5/probe.py``) as its ``matrix.json`` holds it: the
    request's settings and wall time always; the rest as far as the request got."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    fixture_id: str
    seed: int
    n_references: int
    steps: int
    true_cfg_scale: float
    size: str
    wall_s: float
    http: int | None = None  # absent when the request raised
    bytes: int | None = None
    sha256: str | None = None
    structure: Structure | None = None
    usage: dict[str, Any] | None = None
    metrics: dict[str, Any] | None = None
    stage_metrics: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None
    error: str | None = None

    def to_record(self) -> ProbeRecord:
        """As ditq records it: the response's extra metrics merged into ``metrics`` (as the probe merges
        them), out of memory read from the error text (the seed had no error codes), nothing sampled."""
        extra = {k: v for k, v in (("stage_metrics", self.stage_metrics), ("timings", self.timings)) if v}
        return ProbeRecord(
            **self.model_dump(exclude={"structure", "metrics", "stage_metrics", "timings"}),
            structure=self.structure,
            metrics={**(self.metrics or {}), **extra} or None,
            endpoint=None,
            t_start=None,
            t_end=None,
            error_code="out_of_memory" if self.error and _OOM.search(self.error) else None,
            peak_memory_mib=None,
        )


def _read_jsonl(path: Path) -> list[ProbeRecord]:
    records = []
    lines = read_bounded(path).splitlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            raw = loads(line)
        except JsonRefused as error:
            if number == len(lines) and isinstance(error, NotJson):
                log.warning("%s: ignoring a torn last line", path)  # torn by a kill; the runner redoes it
                continue
            raise InputError(f"{path} line {number}: {error}") from None
        records.append(parse(ProbeRecord, raw, f"{path} line {number}"))
    return records


def _read_seed_matrix(path: Path) -> list[ProbeRecord]:
    raw = read_json(path)
    if not isinstance(raw, list):
        raise InputError(f"{path}: (top level): expected a list of records")
    return [parse(SeedRecord, item, f"{path} record {i}").to_record() for i, item in enumerate(raw)]


def read_records(run: Path) -> list[ProbeRecord]:
    """Every record of a run directory (or of one records file), in file order."""
    run = Path(run)
    if run.is_file():
        files = [run]
    elif (run / RECORDS_FILE).exists():
        files = [run / RECORDS_FILE]
    else:
        files = sorted(run.glob("matrix*.json"))
    if not files:
        raise InputError(f"{run}: no {RECORDS_FILE} (nor a seed-style matrix*.json) found")
    return [
        r
        for path in files
        for r in (_read_jsonl(path) if path.suffix == ".jsonl" else _read_seed_matrix(path))
    ]


def latest_by_key(records: list[ProbeRecord]) -> dict[tuple[str, int], ProbeRecord]:
    """One record per (fixture_id, seed): the last one written."""
    return {record.key: record for record in records}


def unrecorded(plan: RunDescription, records: list[ProbeRecord]) -> list[tuple[str, int]]:
    """The requests a run plans (its fixtures x seeds, as RUN.json says) that have no record, in plan order."""
    done = {record.key for record in records}
    return [(f, seed) for f in plan.fixture_ids for seed in plan.seeds if (f, seed) not in done]


def incomplete(run: Path) -> str | None:
    """Why a run directory is not complete, in one clause; None when it is, or when it has no RUN.json to say
    what was planned (the seed's evidence). Complete: RUN.json says so and every planned request has a record."""
    run_file = read_run_file(run)
    if run_file is None:
        return None
    has_records = _present(Path(run) / RECORDS_FILE, "a records file")
    missing = unrecorded(run_file, read_records(run) if has_records else [])
    planned = len(run_file.fixture_ids) * len(run_file.seeds)
    problems = []
    if run_file.status != "complete":
        why = f": {run_file.failure}" if run_file.failure else ""
        problems.append(f"RUN.json says {run_file.status!r}{why}")
    if missing:
        fixture_id, seed = missing[0]
        problems.append(
            f"{len(missing)} of {planned} planned requests have no record (first: {fixture_id} s{seed})"
        )
    return "; ".join(problems) or None


def require_complete(run: Path) -> None:
    """Refuse a run directory that is not complete (``incomplete``): judging it would judge missing evidence."""
    problem = incomplete(run)
    if problem is not None:
        raise InputError(
            f"{run}: the run is not complete ({problem}); rerun the command that made it, with the same --out, "
            "to finish it"
        )


def find_image(run: Path, fixture_id: str, seed: int) -> Path | None:
    """The image of a request in a ditq run (images/) or a seed run (matrix/), if present."""
    run = Path(run)
    if run.is_file():
        run = run.parent
    for folder in (IMAGES_DIR, _SEED_IMAGES_DIR):
        candidate = run / folder / image_name(fixture_id, seed)
        if candidate.is_file():
            return candidate
    return None


def read_run_file(run: Path) -> RunFile | None:
    """The run directory's RUN.json, or None where it has none (the seed's evidence)."""
    path = Path(run) / RUN_FILE
    return read_model(RunFile, path) if _present(path, "a run file") else None


def _present(path: Path, what: str) -> bool:
    """Whether ``path`` is a regular file; absent, False; anything else there (a FIFO, a folder, a broken link),
    never read, is an InputError naming it."""
    if not os.path.lexists(path):
        return False
    if not path.is_file():
        kind = file_kind(os.stat(path).st_mode) if path.exists() else "a broken link"
        raise InputError(f"{path}: {kind}, not {what}")
    return True


def changed_fixtures(run: Path, baseline: Path) -> set[str]:
    """Fixtures both runs name whose prompt, size or reference images differ between them."""
    ours, theirs = read_run_file(run), read_run_file(baseline)
    if ours is None or theirs is None:
        return set()
    before, now = ours.fixture_digests, theirs.fixture_digests
    return {f for f in before.keys() & now.keys() if before[f] != now[f]}
