"""The report's data, gathered from files: run directories, a baseline, and a sweep's candidate records.

A *run directory* is what ``ditq probe`` / ``ditq baseline`` write: ``RUN.json``,
``records.jsonl`` (one request per line), ``images/FIXTURE.sSEED.png``, ``vram.csv``,
and, once the later steps ran, ``gate.json`` and ``compare.json``. The seed's hand-run
evidence (a ``matrix.json`` list of the same records, no images) is read too.

A *candidate directory* is what ``ditq sweep`` writes per scheme: ``CANDIDATE.json``
(scheme, artifact digest, weight bytes, memory budget, the offload attempts, every stage's
status, command and time) and the probe's run directory under ``run/``. A failed stage is a
result, not a crash.

Timing: in a ditq run every probe invocation talked to a freshly started server, whose first
request of each shape (reference count, size) pays for compilation, autotuning and allocator
warm-up. Those requests are marked ``cold``; s/image statistics are taken over the others.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ditq.errors import InputError
from ditq.probe.memory import memory_series, read_vram_csv
from ditq.probe.records import find_image, is_out_of_memory, is_success, read_records
from ditq.report.runfiles import (
    Attempt,
    CandidateFile,
    DoctorSummary,
    Invocation,
    MemoryDescription,
    ServerHealth,
    WeightBytes,
    parse,
)

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
    "mark_cold",
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
    out_of_memory: bool  # the server said the request ran out of accelerator memory
    size: str | None = None  # "WxH"
    offload: str | None = None  # the serving server's offload mode (none | model | block), where it said
    invocation: int | None = None  # which probe invocation (server start) of the run sent it
    endpoint: str | None = None  # the server it went to (an invocation may drain through several)
    t_start: float | None = None  # unix seconds
    cold: bool = False  # the first served request of its shape at its server start (False: not known)

    @property
    def ok(self) -> bool:
        return self.success

    @property
    def shape(self) -> tuple[int, str | None]:
        """What a server warms up for: the reference count and the output size."""
        return (self.n_references, self.size)

    @property
    def key(self) -> tuple[str, int]:
        return (self.fixture_id, self.seed)


@dataclass(frozen=True)
class GateRow:
    fixture_id: str
    seed: int
    passed: bool
    failures: tuple[str, ...]  # names of the failed rules, e.g. ("transparent", "banded")
    inherited: tuple[str, ...] = ()  # signatures the baseline's own image of this fixture and seed shows too


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
    records: list[Record]  # the latest record per (fixture_id, seed)
    gate: list[GateRow] | None  # None: no gate result in this run
    fidelity: list[FidelityRow] | None  # None: no compare result
    parity: dict[str, Any] | None  # compare's parity band for this run, as it wrote it
    parity_fixtures: dict[str, dict[str, Any]]  # compare's per-fixture entries (parity_edge_db, inside_...)
    memory: list[MemorySample]
    has_images: bool
    history: list[Record] = field(default_factory=list)  # every record line, retried ones included
    invocations: list[Invocation] = field(default_factory=list)  # RUN.json: one per server start
    memory_description: MemoryDescription | None = None  # RUN.json: how memory was sampled

    @property
    def label(self) -> str:
        return str(self.run_json.get("label") or self.path.name)

    def image(self, fixture_id: str, seed: int) -> Path | None:
        return find_image(self.path, fixture_id, seed)

    @property
    def peak_memory_bytes(self) -> int | None:
        sampled = [s.used_bytes for s in self.memory]
        reported = [r.peak_memory_bytes for r in self.history if r.peak_memory_bytes is not None]
        values = sampled or reported
        return max(values) if values else None

    @property
    def servers(self) -> list[ServerHealth | None]:
        """What each server this run talked to said on /health, in invocation order (None: nothing readable)."""
        return [server.facts for invocation in self.invocations for server in invocation.servers]

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
    doctor: DoctorSummary | None = None
    extra_commands: list[str] = field(default_factory=list)  # e.g. the server a sweep started for it
    attempts: list[Attempt] = field(default_factory=list)  # the sweep's offload ladder, in order
    weight_bytes: dict[str, WeightBytes] | None = None  # quantized component -> artifact and source bytes

    @property
    def failed_stages(self) -> list[StageStatus]:
        return [s for s in self.stages if s.status == "failed"]

    @property
    def never_loaded(self) -> bool:
        """The sweep tried to serve it and no server loaded the model (at any offload mode)."""
        return bool(self.attempts) and not any(a.loaded for a in self.attempts)

    @property
    def did_not_fit(self) -> bool:
        """Never loaded, and at least one offload mode said the model does not fit in memory."""
        return self.never_loaded and any(a.status == "out_of_memory_at_load" for a in self.attempts)

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
    error = None if error in (None, "") else (error if isinstance(error, str) else json.dumps(error))
    success = is_success(raw)
    # records from before error_code (the seed's) say it only in the error text
    legacy_oom = "error_code" not in raw and not success and bool(_OOM.search(error or ""))
    return Record(
        fixture_id=str(raw["fixture_id"]),
        seed=int(raw["seed"]),
        n_references=int(raw["n_references"]),
        wall_s=None if raw.get("wall_s") is None else float(raw["wall_s"]),
        http=None if raw.get("http") is None else int(raw["http"]),
        error=error,
        structure=dict(raw.get("structure") or {}),
        peak_memory_bytes=peak_bytes,
        success=success,
        out_of_memory=is_out_of_memory(raw) or legacy_oom,
        size=None if raw.get("size") is None else str(raw["size"]),
        offload=None if raw.get("offload") is None else str(raw["offload"]),
        invocation=None if raw.get("invocation") is None else int(raw["invocation"]),
        endpoint=None if raw.get("endpoint") is None else str(raw["endpoint"]),
        t_start=None if raw.get("t_start") is None else float(raw["t_start"]),
    )


def mark_cold(history: list[Record]) -> list[Record]:
    """``history`` with ``cold`` set on the first served request of each shape per server start (invocation and
    endpoint), by start time. Records without an invocation (the seed's, an older probe's) stay warm: not known."""
    first: dict[tuple[int, str | None, int, str | None], int] = {}
    for index, record in enumerate(history):
        if record.invocation is None or not record.ok:
            continue
        slot = (record.invocation, record.endpoint, *record.shape)
        earlier = first.get(slot)
        if earlier is None or (record.t_start or 0.0) < (history[earlier].t_start or 0.0):
            first[slot] = index
    cold = set(first.values())
    return [replace(r, cold=True) if i in cold else r for i, r in enumerate(history)]


def _read_records(run_dir: Path) -> tuple[list[Record], list[Record]]:
    """(latest, history): records.jsonl's lines, the last per key winning (a retried request replaces its
    failure; the earlier lines stay as history), or the seed's matrix*.json."""
    history = mark_cold(
        [_record_from(raw, f"{run_dir} record {i}") for i, raw in enumerate(read_records(run_dir))]
    )
    latest = {record.key: record for record in history}
    return list(latest.values()), history


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
            inherited = tuple(dict.fromkeys(str(i).split(":")[0].strip() for i in row.get("inherited") or []))
            out.append(
                GateRow(str(row["fixture_id"]), int(row["seed"]), _passed(row), _failures(row), inherited)
            )
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


def _read_memory(run_dir: Path, device: int | None) -> list[MemorySample]:
    """vram.csv as (seconds since start, bytes): the server process's memory where the driver showed it,
    else the server's device (``device``), else the fullest one; empty without a GPU."""
    series = memory_series(read_vram_csv(run_dir / "vram.csv"), device)
    if not series:
        return []
    t0 = series[0][0]
    return [MemorySample(t - t0, int(mib * _MIB)) for t, mib in series]


def _run_facts(run_json: dict[str, Any], where: Path) -> tuple[list[Invocation], MemoryDescription | None]:
    """RUN.json's server starts and memory description, typed (a run written before them has neither)."""
    raw_invocations = run_json.get("invocations", [])
    if not isinstance(raw_invocations, list):
        raise InputError(f"{where}: invocations: expected a list")
    invocations = [
        parse(Invocation, raw, f"{where} invocations.{i}") for i, raw in enumerate(raw_invocations)
    ]
    memory = run_json.get("memory")
    return invocations, None if memory is None else parse(MemoryDescription, memory, f"{where} memory")


def load_run(run_dir: Path) -> RunData:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise InputError(f"{run_dir}: no such run directory")
    run_json_path = run_dir / "RUN.json"
    run_json = _read_json(run_json_path) if run_json_path.is_file() else {}
    if not isinstance(run_json, dict):
        raise InputError(f"{run_json_path}: expected a JSON object")
    invocations, memory_description = _run_facts(run_json, run_json_path)
    devices = [s.facts.cuda_index for i in invocations for s in i.servers if s.facts is not None]
    records, history = _read_records(run_dir)
    fidelity, parity, parity_fixtures = _read_compare(run_dir)
    return RunData(
        path=run_dir,
        run_json=run_json,
        records=sorted(records, key=lambda r: (r.n_references, r.fixture_id, r.seed)),
        gate=_read_gate(run_dir),
        fidelity=fidelity,
        parity=parity,
        parity_fixtures=parity_fixtures,
        memory=_read_memory(run_dir, next((d for d in devices if d is not None), None)),
        has_images=(run_dir / "images").is_dir() or (run_dir / "matrix").is_dir(),
        history=history,
        invocations=invocations,
        memory_description=memory_description,
    )


def load_candidate(path: Path, attempts: list[Attempt] | None = None) -> Candidate:
    """A sweep's candidate directory (CANDIDATE.json [+ run/]) or a bare run directory (whose offload
    ``attempts``, a sweep's baseline say, may be given)."""
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
            attempts=list(attempts or []),
        )
    raw = parse(CandidateFile, _read_json(description), str(description))
    run_dir = path / raw.run
    has_run = (run_dir / "records.jsonl").is_file() or any(run_dir.glob("matrix*.json"))
    return Candidate(
        name=raw.name,
        scheme=raw.scheme,
        run=load_run(run_dir) if has_run else None,
        artifact_digest=raw.artifact_digest,
        memory_budget=raw.max_memory,
        endpoint=raw.endpoint,
        stages=[
            StageStatus(name, s.status, s.message, s.command, s.seconds) for name, s in raw.stages.items()
        ],
        doctor=raw.doctor,
        attempts=list(attempts or raw.attempts),
        weight_bytes=raw.weight_bytes,
    )
