"""Run records: one JSON object per request, appended and fsynced as each completes.

A record carries the seed probe's fields (fixture_id, seed, n_references, steps,
true_cfg_scale, size, wall_s, http, bytes, sha256, structure, usage, metrics,
error) plus endpoint, t_start/t_end (unix seconds), peak_memory_mib, error_code
(the code of an OpenAI error envelope, e.g. ``out_of_memory``), and, where the
server says so on /health, its offload mode and the probe invocation (one per
server start) that sent it. The key of a record is (fixture_id, seed); when a
key was retried, the last line wins, and the earlier lines stay as history.

Readers accept ditq runs (``records.jsonl``, ``images/``) and the seed probe's
layout (``matrix*.json`` lists, ``matrix/`` images) as they are.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

from ditq.errors import InputError

__all__ = [
    "IMAGES_DIR",
    "RECORDS_FILE",
    "RUN_FILE",
    "RecordLog",
    "changed_fixtures",
    "find_image",
    "fixture_digests_of",
    "image_name",
    "is_out_of_memory",
    "is_success",
    "latest_by_key",
    "read_records",
    "record_key",
]

log = logging.getLogger(__name__)

RECORDS_FILE = "records.jsonl"
RUN_FILE = "RUN.json"
IMAGES_DIR = "images"
_SEED_IMAGES_DIR = "matrix"

Record = dict[str, Any]


def record_key(record: Record) -> tuple[str, int]:
    return str(record["fixture_id"]), int(record["seed"])


def image_name(fixture_id: str, seed: int) -> str:
    return f"{fixture_id}.s{seed}.png"


def is_success(record: Record) -> bool:
    """An image came back (over HTTP 200, or in process where ``http`` is null) and nothing failed."""
    return record.get("http") in (200, None) and bool(record.get("sha256")) and not record.get("error")


def is_out_of_memory(record: Record) -> bool:
    """The server answered that this request ran out of accelerator memory (503 ``out_of_memory``)."""
    return record.get("error_code") == "out_of_memory"


class RecordLog:
    """Append-only records.jsonl; a torn last line left by a killed run is cut off on open."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._repair()
        self._handle = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - held for the run

    def _repair(self) -> None:
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            keep = data.rfind(b"\n") + 1
            log.warning(
                "%s: dropping a torn last line (%d bytes) left by an interrupted run",
                self.path,
                len(data) - keep,
            )
            with open(self.path, "r+b") as handle:
                handle.truncate(keep)

    def append(self, record: Record) -> None:
        line = json.dumps(record, sort_keys=False) + "\n"
        with self._lock:
            self._handle.write(line)
            self._handle.flush()
            os.fsync(self._handle.fileno())

    def close(self) -> None:
        with self._lock:
            self._handle.close()

    def __enter__(self) -> RecordLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _read_jsonl(path: Path) -> list[Record]:
    records = []
    lines = path.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines):  # torn by a kill; the runner redoes that request
                log.warning("%s: ignoring a torn last line", path)
                continue
            raise InputError(f"{path}: line {number} is not valid JSON") from None
    return records


def read_records(run: Path) -> list[Record]:
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
    records: list[Record] = []
    for path in files:
        if path.suffix == ".jsonl":
            records.extend(_read_jsonl(path))
            continue
        try:
            loaded = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as error:
            raise InputError(f"{path}: not valid JSON ({error})") from None
        if not isinstance(loaded, list):
            raise InputError(f"{path}: expected a list of records")
        records.extend(loaded)
    for index, record in enumerate(records):
        if not isinstance(record, dict) or "fixture_id" not in record or "seed" not in record:
            raise InputError(f"{run}: record {index} lacks 'fixture_id' or 'seed'")
    return records


def latest_by_key(records: list[Record]) -> dict[tuple[str, int], Record]:
    """One record per (fixture_id, seed): the last one written."""
    latest: dict[tuple[str, int], Record] = {}
    for record in records:
        latest[record_key(record)] = record
    return latest


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


def fixture_digests_of(run: Path) -> dict[str, str]:
    """The per-fixture digests RUN.json recorded (empty for a run without them, e.g. the seed's)."""
    path = Path(run) / RUN_FILE
    if not path.is_file():
        return {}
    digests = json.loads(path.read_text()).get("fixture_digests")
    return dict(digests) if isinstance(digests, dict) else {}


def changed_fixtures(run: Path, baseline: Path) -> set[str]:
    """Fixtures both runs name whose prompt, size or reference images differ between them."""
    ours, theirs = fixture_digests_of(run), fixture_digests_of(baseline)
    return {f for f in ours.keys() & theirs.keys() if ours[f] != theirs[f]}
