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

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ditq.errors import InputError
from ditq.fsutil import sha256_file
from ditq.judge.compare import LosslessStandard
from ditq.probe.memory import memory_series, read_vram_csv
from ditq.probe.records import (
    find_image,
    incomplete,
    is_out_of_memory,
    is_success,
    read_records,
    read_run_file,
)
from ditq.quantization.plan_file import PLAN_FILE, PlanFile, read_plan
from ditq.runfiles import (
    CANDIDATE_FILE,
    COMPARE_FILE,
    GATE_FILE,
    RECORDS_FILE,
    RUN_FILE,
    Attempt,
    CandidateFile,
    CompareFile,
    DoctorSummary,
    FixtureFidelity,
    GateFile,
    InProcessOptions,
    Invocation,
    MemoryDescription,
    ParallelFacts,
    ParityResult,
    ProbeRecord,
    RunFile,
    ServerHealth,
    WeightBytes,
    read_model,
)

__all__ = [
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
    parallel: str | None = None  # the serving server's --parallel (cp=2), where it said; None: one device
    invocation: int | None = None  # which probe invocation (server start) of the run sent it
    endpoint: str | None = None  # the server it went to (an invocation may drain through several)
    t_start: float | None = None  # unix seconds
    cold: bool = False  # the first served request of its shape at its server start (False: not known)
    # Where the server reported them (ditq serve with return_stage_metrics, on CUDA): peak allocated bytes per
    # stage, what was allocated when the request began, and the cost model's predicted peak
    stage_peaks: dict[str, int] | None = None
    start_bytes: int | None = None
    predicted_peak_bytes: int | None = None
    stage_seconds: dict[str, float] | None = None  # text_encoding, step (mean), decoding: as the server said
    # a server with --cache: the steps of this request served from the step cache, and the steps it ran
    skipped_steps: int | None = None
    steps: int | None = None

    @property
    def measured_peak_bytes(self) -> int | None:
        """The peak allocated bytes the server measured for this request (its stages' largest)."""
        return max(self.stage_peaks.values()) if self.stage_peaks else None

    @property
    def ok(self) -> bool:
        return self.success

    @property
    def devices(self) -> int:
        """The devices the server generated on: its --parallel degree (cp=2 -> 2), else one."""
        return ParallelFacts.degree_of(self.parallel) if self.parallel else 1

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
    run_file: RunFile | None  # None: the seed's evidence, which has no RUN.json
    records: list[Record]  # the latest record per (fixture_id, seed)
    gate: list[GateRow] | None  # None: no gate result in this run
    fidelity: list[FidelityRow] | None  # None: no compare result
    parity: ParityResult | None  # compare's parity band for this run
    parity_fixtures: dict[str, FixtureFidelity]  # compare's per-fixture entries (parity_edge_db, inside_...)
    memory: list[MemorySample]
    has_images: bool
    history: list[Record] = field(default_factory=list)  # every record line, retried ones included
    incomplete: str | None = None  # why the run is not complete (ditq.probe.records.incomplete); None: it is
    same_as_baseline: int = 0  # compared images that are the baseline's, byte for byte

    @property
    def label(self) -> str:
        return self.path.name

    def take_compare(self, compare: CompareFile | None) -> None:
        """The run's fidelity as ``compare`` has it (compare.json as read, or compare run again by the report)."""
        self.fidelity = None if compare is None else _fidelity(compare)
        self.parity = None if compare is None else compare.parity
        self.parity_fixtures = {} if compare is None else dict(compare.fixtures)
        self.same_as_baseline = 0 if compare is None else sum(1 for row in compare.rows if row.same_bytes)

    @property
    def invocations(self) -> list[Invocation]:
        """RUN.json's server starts, in order."""
        return [] if self.run_file is None else self.run_file.invocations

    @property
    def memory_description(self) -> MemoryDescription | None:
        """How memory was sampled (RUN.json)."""
        return None if self.run_file is None else self.run_file.memory

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
    def device(self) -> str | None:
        """Where the images were made: the in-process baseline's device, else the first server's, where it said."""
        options = None if self.run_file is None else self.run_file.options
        if isinstance(options, InProcessOptions):
            return options.device
        return next((s.device for s in self.servers if s is not None and s.device), None)

    @property
    def reference_counts(self) -> list[int]:
        return sorted({r.n_references for r in self.records})

    def records_with(self, n_references: int) -> list[Record]:
        return [r for r in self.records if r.n_references == n_references]

    @property
    def commands(self) -> list[str]:
        """RUN.json records what was run rather than the command line: say that, field by field."""
        if self.run_file is None:
            return []
        run = self.run_file
        facts = {
            "kind": run.kind,
            "model": run.model,
            "endpoints": run.endpoints,
            "fixtures_file": run.fixtures_file,
            "seeds": run.seeds,
            "steps": run.steps,
            "true_cfg_scale": run.true_cfg_scale,
        }
        return ["(from RUN.json) " + ", ".join(f"{k}={v}" for k, v in facts.items() if v is not None)]


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
    seeds_added: dict[str, int] = field(default_factory=dict)  # --seeds auto: fixture -> seeds added
    seed_commands: list[str] = field(default_factory=list)  # --seeds auto: the commands that added them
    plan: PlanFile | None = (
        None  # a planned candidate's PLAN.json (sweep --plan copies it beside CANDIDATE.json)
    )

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
        return [
            *self.extra_commands,
            *(from_stages or (self.run.commands if self.run else [])),
            *self.seed_commands,
        ]


def _mib_bytes(value: Any) -> int | None:
    return int(value * _MIB) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _stage_facts(metrics: dict[str, Any]) -> dict[str, Any]:
    """The server's memory by stage, start and prediction (MiB in its words) as bytes; its stage seconds."""
    stages = metrics.get("stage_peak_memory_mb")
    peaks = (
        {str(k): b for k, v in stages.items() if (b := _mib_bytes(v)) is not None}
        if isinstance(stages, dict)
        else None
    )
    seconds = {
        stage: float(metrics[key]) / 1000
        for stage, key in (
            ("text_encoding", "text_encoding_ms"),
            ("step", "denoise_step_latency_ms"),
            ("decoding", "decoding_ms"),
        )
        if isinstance(metrics.get(key), int | float)
    }
    skipped, steps = metrics.get("skipped_steps"), metrics.get("num_inference_steps")
    return {
        "skipped_steps": skipped if isinstance(skipped, int) else None,
        "steps": steps if isinstance(steps, int) else None,
        "stage_peaks": peaks or None,
        "start_bytes": _mib_bytes(metrics.get("memory_at_start_mb")),
        "predicted_peak_bytes": _mib_bytes(metrics.get("predicted_peak_memory_mb")),
        "stage_seconds": seconds or None,
    }


def _record_from(raw: ProbeRecord) -> Record:
    peak_mib = raw.peak_memory_mib if raw.peak_memory_mib is not None else raw.server_peak_mib
    return Record(
        fixture_id=raw.fixture_id,
        seed=raw.seed,
        n_references=raw.n_references,
        wall_s=raw.wall_s,
        http=raw.http,
        error=raw.error or None,
        structure={} if raw.structure is None else raw.structure.as_metrics(),
        peak_memory_bytes=None if peak_mib is None else int(peak_mib * _MIB),
        success=is_success(raw),
        out_of_memory=is_out_of_memory(raw),
        size=raw.size,
        offload=raw.offload,
        parallel=raw.parallel,
        invocation=raw.invocation,
        endpoint=raw.endpoint,
        t_start=raw.t_start,
        **_stage_facts(raw.metrics or {}),
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
    history = mark_cold([_record_from(raw) for raw in read_records(run_dir)])
    latest = {record.key: record for record in history}
    return list(latest.values()), history


def _read_gate(run_dir: Path) -> list[GateRow] | None:
    path = run_dir / GATE_FILE
    if not path.is_file():
        return None
    return [
        GateRow(r.fixture_id, r.seed, r.passed, tuple(r.failed_rules), tuple(r.inherited_rules))
        for r in read_model(GateFile, path).records
    ]


def _read_compare(run_dir: Path) -> CompareFile | None:
    """compare.json; one written before the lossless standard gets its lossless decisions here, from its own
    rows at the default thresholds (every PSNR and SSIM it needs is in them)."""
    path = run_dir / COMPARE_FILE
    if not path.is_file():
        return None
    compare = read_model(CompareFile, path)
    if compare.lossless is not None:
        return compare
    standard = LosslessStandard()
    fixtures = {}
    for fixture_id, entry in compare.fixtures.items():
        ok = [r for r in compare.rows if r.fixture_id == fixture_id and r.status == "ok"]
        fixtures[fixture_id] = entry.model_copy(update={"lossless": standard.decide_rows(ok)})
    return compare.model_copy(update={"fixtures": fixtures})


def _fidelity(compare: CompareFile) -> list[FidelityRow]:
    return [
        FidelityRow(
            r.fixture_id, r.seed, r.psnr_db, r.ssim, r.error or (None if r.status == "ok" else r.status)
        )
        for r in compare.rows
    ]


def _read_memory(run_dir: Path, device: int | None) -> list[MemorySample]:
    """vram.csv as (seconds since start, bytes): the server process's memory where the driver showed it,
    else the server's device (``device``), else the fullest one; empty without a GPU."""
    series = memory_series(read_vram_csv(run_dir / "vram.csv"), device)
    if not series:
        return []
    t0 = series[0][0]
    return [MemorySample(t - t0, int(mib * _MIB)) for t, mib in series]


def load_run(run_dir: Path) -> RunData:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise InputError(f"{run_dir}: no such run directory")
    run_file = read_run_file(run_dir)
    invocations = [] if run_file is None else run_file.invocations
    devices = [s.cuda_index for i in invocations for s in i.servers]
    records, history = _read_records(run_dir)
    run = RunData(
        path=run_dir,
        run_file=run_file,
        records=sorted(records, key=lambda r: (r.n_references, r.fixture_id, r.seed)),
        gate=_read_gate(run_dir),
        fidelity=None,
        parity=None,
        parity_fixtures={},
        memory=_read_memory(run_dir, next((d for d in devices if d is not None), None)),
        has_images=(run_dir / "images").is_dir() or (run_dir / "matrix").is_dir(),
        history=history,
        incomplete=incomplete(run_dir),
    )
    run.take_compare(_read_compare(run_dir))
    return run


def served_digests(run: RunData) -> set[str | None]:
    """The artifact digests the run's servers said they served, one per server start (None: one did not say)."""
    return {None if s is None else s.artifact_digest for s in run.servers}


def _chained(description: Path, raw: CandidateFile, run: RunData | None) -> None:
    """The candidate's run was made by serving its own artifact: CANDIDATE.json's digest is its artifact's
    MANIFEST.json's (where the artifact is still there), and every server start of the run said it served that
    artifact. A run probed through an endpoint of the user's (``endpoint``) cannot say: the report shows it."""
    manifest = Path(raw.artifact) / "MANIFEST.json" if raw.artifact else None
    if manifest is not None and manifest.is_file() and sha256_file(manifest) != raw.artifact_digest:
        raise InputError(f"{description}: artifact_digest is not the sha256 of {manifest}")
    if run is None or run.run_file is None or raw.endpoint is not None:
        return
    served = served_digests(run)
    if not served or served != {raw.artifact_digest} or raw.artifact_digest is None:
        said = ", ".join(sorted(str(d)[:16] for d in served)) or "nothing"
        raise InputError(
            f"{run.path / RUN_FILE}: its servers served artifact {said}, not this candidate's "
            f"{str(raw.artifact_digest)[:16]} ({description}): the run of another artifact, or made before ditq "
            "recorded it (probe it again)"
        )


def _run_dir(path: Path, description: Path, raw: CandidateFile) -> Path:
    """The candidate's run folder: a folder of its own, not a link out of it."""
    run_dir = path / raw.run
    if Path(os.path.realpath(run_dir)).parent != Path(os.path.realpath(path)):
        raise InputError(f"{description}: run {raw.run!r} leads out of the candidate's folder")
    return run_dir


def load_candidate(path: Path, attempts: list[Attempt] | None = None) -> Candidate:
    """A sweep's candidate directory (CANDIDATE.json [+ run/]) or a bare run directory (whose offload
    ``attempts``, a sweep's baseline say, may be given). A candidate's run is chained to its artifact
    (``_chained``); a bare run's artifact digest is the one its servers said, where they agree."""
    path = Path(path)
    description = path / CANDIDATE_FILE
    if not description.is_file():
        bare = load_run(path)
        served = served_digests(bare)
        digest = next(iter(served)) if len(served) == 1 else None
        return Candidate(
            name=bare.label, scheme=None, run=bare, attempts=list(attempts or []), artifact_digest=digest
        )
    raw = read_model(CandidateFile, description)
    run_dir = _run_dir(path, description, raw)
    has_run = (run_dir / RECORDS_FILE).is_file() or any(run_dir.glob("matrix*.json"))
    run = load_run(run_dir) if has_run else None
    _chained(description, raw, run)
    return Candidate(
        name=raw.name,
        scheme=raw.scheme,
        run=run,
        artifact_digest=raw.artifact_digest,
        memory_budget=raw.max_memory,
        endpoint=raw.endpoint,
        stages=[
            StageStatus(name, s.status, s.message, s.command, s.seconds) for name, s in raw.stages.items()
        ],
        doctor=raw.doctor,
        attempts=list(attempts or raw.attempts),
        weight_bytes=raw.weight_bytes,
        seeds_added=dict(raw.seeds_added),
        seed_commands=list(raw.seed_commands),
        plan=read_plan(path / PLAN_FILE) if (path / PLAN_FILE).is_file() else None,
    )
