"""The report's data, gathered from files: run directories, a baseline, and a sweep's candidate records.

A *run directory* is what ``ditq probe`` / ``ditq baseline`` write: ``RUN.json``,
``records.jsonl`` (one request per line), ``images/FIXTURE.sSEED.png``, ``vram.csv``,
and, once the later steps ran, ``gate.json`` and ``compare.json``. The seed's hand-run
evidence (a ``matrix.json`` list of the same records, no images) is read too.

A *candidate directory* is what ``ditq sweep`` writes per scheme: ``CANDIDATE.json``
(scheme, artifact digest, memory budget, every stage's status and command) and the
probe's run directory under ``run/``. A failed stage is a result, not a crash.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ditq.errors import InputError
from ditq.probe.memory import read_vram_csv
from ditq.probe.records import find_image, is_success, latest_by_key, read_records

__all__ = [
    "CANDIDATE_FILE",
    "Candidate",
    "FidelityRow",
    "GateRow",
    "MemorySample",
    "Record",
    "RunData",
    "StageStatus",
    "load_candidate",
    "load_run",
]

CANDIDATE_FILE = "CANDIDATE.json"
_OOM = re.compile(r"out[ _-]of[ _-]memory|\boom\b", re.IGNORECASE)
_MIB = 1 << 20


@dataclass(frozen=True)
class Record:
    """One request of the matrix (the seed's ``matrix.json`` fields that the report uses)."""

    fixture_id: str
    seed: int
    n_references: int
    wall_s: float | None
    http: int | None
    error: str | None
    structure: dict[str, Any]
    peak_memory_bytes: int | None  # sampled over the request's window, else as the server reported it
    success: bool  # an image came back and nothing failed (the probe's own definition)

    @property
    def ok(self) -> bool:
        return self.success

    @property
    def out_of_memory(self) -> bool:
        return not self.ok and bool(_OOM.search(self.error or ""))

    @property
    def key(self) -> tuple[str, int]:
        return (self.fixture_id, self.seed)


@dataclass(frozen=True)
class GateRow:
    fixture_id: str
    seed: int
    passed: bool
    failures: tuple[str, ...]  # names of the failed rules, e.g. ("transparent", "banded")


@dataclass(frozen=True)
class FidelityRow:
    fixture_id: str
    seed: int
    psnr_db: float | None
    ssim: float | None
    error: str | None  # a size mismatch or a missing image, as compare reported it


@dataclass(frozen=True)
class MemorySample:
    t_s: float  # seconds since the first sample
    used_bytes: int


@dataclass
class RunData:
    path: Path
    run_json: dict[str, Any]
    records: list[Record]
    gate: list[GateRow] | None  # None: no gate result in this run
    fidelity: list[FidelityRow] | None  # None: no compare result
    parity: dict[str, Any] | None  # compare's parity band for this run, as it wrote it
    parity_fixtures: dict[str, dict[str, Any]]  # compare's per-fixture entries (parity_edge_db, inside_...)
    memory: list[MemorySample]
    has_images: bool

    @property
    def label(self) -> str:
        return str(self.run_json.get("label") or self.path.name)

    def image(self, fixture_id: str, seed: int) -> Path | None:
        return find_image(self.path, fixture_id, seed)

    @property
    def peak_memory_bytes(self) -> int | None:
        sampled = [s.used_bytes for s in self.memory]
        reported = [r.peak_memory_bytes for r in self.records if r.peak_memory_bytes is not None]
        values = sampled or reported
        return max(values) if values else None

    @property
    def reference_counts(self) -> list[int]:
        return sorted({r.n_references for r in self.records})

    def records_with(self, n_references: int) -> list[Record]:
        return [r for r in self.records if r.n_references == n_references]

    @property
    def commands(self) -> list[str]:
        command = self.run_json.get("command") or self.run_json.get("argv")
        if isinstance(command, list):
            return [" ".join(str(part) for part in command)]
        if command:
            return [str(command)]
        if not self.run_json:
            return []
        # RUN.json records what was run rather than the command line: say that, field by field
        facts = ("kind", "model", "endpoints", "fixtures_file", "seeds", "steps", "true_cfg_scale")
        described = ", ".join(f"{k}={self.run_json[k]}" for k in facts if self.run_json.get(k) is not None)
        return [f"(from RUN.json) {described}"] if described else []


@dataclass(frozen=True)
class StageStatus:
    name: str  # quantize, verify, doctor, serve, probe, gate, compare
    status: str  # "ok" | "failed" | "skipped"
    message: str | None = None
    command: str | None = None
    seconds: float | None = None


@dataclass
class Candidate:
    """One quantized candidate (or the BF16 baseline) as the report sees it."""

    name: str
    scheme: str | None
    run: RunData | None  # None when a stage before the probe failed
    artifact_digest: str | None = None
    memory_budget: str | None = None
    endpoint: str | None = None
    stages: list[StageStatus] = field(default_factory=list)
    doctor: dict[str, Any] | None = None  # {"passed": bool, "failing": [path names], "report": ...}
    extra_commands: list[str] = field(default_factory=list)  # e.g. the server a sweep started for it

    @property
    def failed_stages(self) -> list[StageStatus]:
        return [s for s in self.stages if s.status == "failed"]

    @property
    def commands(self) -> list[str]:
        from_stages = [s.command for s in self.stages if s.command]
        return [*self.extra_commands, *(from_stages or (self.run.commands if self.run else []))]


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise InputError(f"{path}: not valid JSON ({error.msg} at line {error.lineno})") from None


def _record_from(raw: dict[str, Any], where: str) -> Record:
    for name in ("fixture_id", "seed", "n_references"):
        if name not in raw:
            raise InputError(f"{where}: record lacks the field {name!r}")
    metrics = raw.get("metrics") or {}
    peak_mib = raw.get("peak_memory_mib")  # the probe's sampler, over this request's window
    if peak_mib is None and isinstance(metrics, dict):
        peak_mib = metrics.get("peak_memory_mb")  # the server's own report (the seed's records)
    peak_bytes = None if peak_mib is None else int(float(peak_mib) * _MIB)
    error = raw.get("error")
    return Record(
        fixture_id=str(raw["fixture_id"]),
        seed=int(raw["seed"]),
        n_references=int(raw["n_references"]),
        wall_s=None if raw.get("wall_s") is None else float(raw["wall_s"]),
        http=None if raw.get("http") is None else int(raw["http"]),
        error=None if error in (None, "") else (error if isinstance(error, str) else json.dumps(error)),
        structure=dict(raw.get("structure") or {}),
        peak_memory_bytes=peak_bytes,
        success=is_success(raw),
    )


def _read_records(run_dir: Path) -> list[Record]:
    """records.jsonl (the last line per key wins: a retried request replaces its failure), or matrix*.json."""
    latest = latest_by_key(read_records(run_dir))
    return [_record_from(raw, f"{run_dir} record {key}") for key, raw in latest.items()]


def _rows(document: Any, run_dir: Path) -> list[dict[str, Any]] | None:
    """The per-request rows of a gate.json / compare.json: top-level, or under this run's entry."""
    if isinstance(document, list):
        return [row for row in document if isinstance(row, dict)]
    if not isinstance(document, dict):
        return None
    for key in ("records", "rows", "results"):
        if isinstance(document.get(key), list):
            return [row for row in document[key] if isinstance(row, dict)]
    runs = document.get("runs")
    if isinstance(runs, list):
        chosen = [r for r in runs if isinstance(r, dict) and Path(str(r.get("run", ""))).name == run_dir.name]
        for run in chosen or runs[:1]:
            rows = _rows(run, run_dir)
            if rows is not None:
                return rows
    return None


def _passed(row: dict[str, Any]) -> bool:
    for key in ("passed", "pass", "ok"):
        if isinstance(row.get(key), bool):
            return bool(row[key])
    verdict = str(row.get("verdict") or row.get("status") or "").upper()
    if verdict in ("PASS", "FAIL"):
        return verdict == "PASS"
    raise KeyError("no pass/fail field")


def _failures(row: dict[str, Any]) -> tuple[str, ...]:
    for key in ("failures", "failed_rules", "reasons", "signatures"):
        value = row.get(key)
        if isinstance(value, list):
            # gate.json reasons read "transparent: opaque_fraction 0.19 < 0.5": the rule's name comes first
            names = (str(v.get("rule", v.get("name", v))) if isinstance(v, dict) else str(v) for v in value)
            return tuple(dict.fromkeys(name.split(":")[0].strip() for name in names))
    return ()


def _read_gate(run_dir: Path) -> list[GateRow] | None:
    path = run_dir / "gate.json"
    if not path.is_file():
        return None
    rows = _rows(_read_json(path), run_dir)
    if rows is None:
        raise InputError(f"{path}: no per-request rows (expected 'records')")
    out = []
    for i, row in enumerate(rows):
        try:
            out.append(GateRow(str(row["fixture_id"]), int(row["seed"]), _passed(row), _failures(row)))
        except KeyError as error:
            raise InputError(f"{path}: row {i} lacks {error.args[0]}") from None
    return out


def _number(value: Any) -> float | None:
    if value is None:
        return None
    number = float(value)  # "inf" (identical images) parses; NaN is no measurement
    return None if math.isnan(number) else number


def _read_compare(
    run_dir: Path,
) -> tuple[list[FidelityRow] | None, dict[str, Any] | None, dict[str, dict[str, Any]]]:
    path = run_dir / "compare.json"
    if not path.is_file():
        return None, None, {}
    document = _read_json(path)
    rows = _rows(document, run_dir)
    if rows is None:
        raise InputError(f"{path}: no per-image rows (expected 'rows')")
    fidelity = []
    for i, row in enumerate(rows):
        if "fixture_id" not in row or "seed" not in row:
            raise InputError(f"{path}: row {i} lacks fixture_id or seed")
        psnr = row.get("psnr_db", row.get("psnr"))
        fidelity.append(
            FidelityRow(
                str(row["fixture_id"]),
                int(row["seed"]),
                _number(psnr),
                _number(row.get("ssim")),
                row.get("error") or (None if row.get("status") in (None, "ok") else str(row["status"])),
            )
        )
    parity = document.get("parity") if isinstance(document, dict) else None
    fixtures = document.get("fixtures") if isinstance(document, dict) else None
    return (
        fidelity,
        parity if isinstance(parity, dict) else None,
        {str(k): v for k, v in fixtures.items() if isinstance(v, dict)} if isinstance(fixtures, dict) else {},
    )


def _read_memory(run_dir: Path) -> list[MemorySample]:
    """vram.csv as (seconds since start, bytes used on the fullest device); empty without a GPU."""
    by_time: dict[float, float] = {}
    for sample in read_vram_csv(run_dir / "vram.csv"):
        by_time[sample.t_unix] = max(by_time.get(sample.t_unix, 0.0), sample.used_mib)
    if not by_time:
        return []
    t0 = min(by_time)
    return [MemorySample(t - t0, int(used * _MIB)) for t, used in sorted(by_time.items())]


def load_run(run_dir: Path) -> RunData:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise InputError(f"{run_dir}: no such run directory")
    run_json_path = run_dir / "RUN.json"
    run_json = _read_json(run_json_path) if run_json_path.is_file() else {}
    if not isinstance(run_json, dict):
        raise InputError(f"{run_json_path}: expected a JSON object")
    records = _read_records(run_dir)
    fidelity, parity, parity_fixtures = _read_compare(run_dir)
    return RunData(
        path=run_dir,
        run_json=run_json,
        records=sorted(records, key=lambda r: (r.n_references, r.fixture_id, r.seed)),
        gate=_read_gate(run_dir),
        fidelity=fidelity,
        parity=parity,
        parity_fixtures=parity_fixtures,
        memory=_read_memory(run_dir),
        has_images=(run_dir / "images").is_dir() or (run_dir / "matrix").is_dir(),
    )


def _stages(raw: Any, where: Path) -> list[StageStatus]:
    if not isinstance(raw, dict):
        return []
    stages = []
    for name, value in raw.items():
        if not isinstance(value, dict) or value.get("status") not in ("ok", "failed", "skipped"):
            raise InputError(f"{where}: stage {name!r} needs a status of ok, failed or skipped")
        stages.append(
            StageStatus(
                name, value["status"], value.get("message"), value.get("command"), value.get("seconds")
            )
        )
    return stages


def load_candidate(path: Path) -> Candidate:
    """A sweep's candidate directory (CANDIDATE.json [+ run/]) or a bare run directory."""
    path = Path(path)
    description = path / CANDIDATE_FILE
    if not description.is_file():
        run = load_run(path)
        scheme = run.run_json.get("scheme")
        return Candidate(
            name=run.label,
            scheme=str(scheme) if scheme else None,
            run=run,
            artifact_digest=run.run_json.get("artifact_digest"),
            memory_budget=run.run_json.get("max_memory"),
        )
    raw = _read_json(description)
    if not isinstance(raw, dict) or "name" not in raw:
        raise InputError(f"{description}: expected an object with a 'name'")
    run_dir = path / str(raw.get("run", "run"))
    has_run = (run_dir / "records.jsonl").is_file() or any(run_dir.glob("matrix*.json"))
    return Candidate(
        name=str(raw["name"]),
        scheme=raw.get("scheme"),
        run=load_run(run_dir) if has_run else None,
        artifact_digest=raw.get("artifact_digest"),
        memory_budget=raw.get("max_memory"),
        endpoint=raw.get("endpoint"),
        stages=_stages(raw.get("stages"), description),
        doctor=raw.get("doctor"),
    )
