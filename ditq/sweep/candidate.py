"""One candidate of a sweep: its directory, its stages' records (CANDIDATE.json), and what its files say."""

from __future__ import annotations

import contextlib
import json
import shlex
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from ditq.errors import InputError
from ditq.fsutil import sha256_file
from ditq.probe.fixtures import DEFAULT_SEEDS
from ditq.probe.records import incomplete, is_out_of_memory, latest_by_key, read_records
from ditq.quantization.plan_file import KEEP
from ditq.runfiles import (
    CANDIDATE_FILE,
    RECORDS_FILE,
    RUN_FILE,
    Attempt,
    CandidateFile,
    DoctorFile,
    DoctorSummary,
    RunFile,
    StageEntry,
    WeightBytes,
    read_model,
    write_model,
)
from ditq.schemes import SCHEMES
from ditq.sweep import launch
from ditq.sweep.options import (
    PLAN_CANDIDATE,
    SCHEME_STAGES,
    SweepOptions,
    candidate_scheme,
    shared_candidate,
)


class Candidate:
    """One scheme's directory and CANDIDATE.json, rewritten (atomically) after every stage."""

    def __init__(self, options: SweepOptions, scheme: str) -> None:
        self.options, self.scheme = options, scheme
        self.plan = options.plan_file if scheme == PLAN_CANDIDATE else None
        self.dir = options.out / scheme
        self.shares = shared_candidate(
            options, scheme
        )  # the candidate whose artifact this one serves, if any
        artifact_dir = self.dir if self.shares is None else options.out / self.shares
        # an earlier sweep's artifact (``options.artifacts_from``), the plan's excepted: this candidate serves it
        self.earlier = (
            None if options.artifacts_from is None or self.plan is not None else options.artifacts_from
        )
        if self.earlier is not None:
            artifact_dir = self.earlier / (self.shares or scheme)
        self.artifact, self.run_dir, self.logs = (
            artifact_dir / "artifact",
            self.dir / "run",
            self.dir / "logs",
        )
        path = self.dir / CANDIDATE_FILE
        previous = read_model(CandidateFile, path) if path.is_file() else CandidateFile(name=scheme)
        self.stages: dict[str, StageEntry] = dict(previous.stages)
        self.doctor: DoctorSummary | None = previous.doctor
        self.attempts: list[Attempt] = list(previous.attempts)  # the offload ladder
        self.seeds_added: dict[str, int] = dict(previous.seeds_added)  # --seeds auto
        self.seed_commands: list[str] = list(previous.seed_commands)  # the commands that added them
        self.dirty = False  # a stage ran in this sweep: every later stage runs again
        if (self.shares or self.earlier) is not None and previous.artifact_digest != self.artifact_digest():
            self.dirty = True  # the shared artifact was quantized again since this candidate last served it
        self.reached: set[str] = set()  # stages this sweep got to (the rest follow a failure)

    def artifact_digest(self) -> str | None:
        """The artifact's manifest digest, or None while there is none."""
        manifest = self.artifact / "MANIFEST.json"
        return sha256_file(manifest) if manifest.is_file() else None

    def save(self) -> None:
        manifest = self.artifact / "MANIFEST.json"
        weight_bytes = (
            artifact_weight_bytes(self.artifact, self.options.model, self.options.load.variant)
            if manifest.is_file()
            else None
        )
        candidate = CandidateFile(
            name=self.scheme,
            scheme=candidate_scheme(self.scheme)
            if self.plan is None
            else plan_label(self.plan.layers.values()),
            artifact=str(self.artifact),
            artifact_digest=self.artifact_digest(),
            weight_bytes=weight_bytes,
            max_memory=self.options.load.max_memory,
            endpoint=self.options.endpoint_for.get(self.scheme),
            run="run",
            doctor=self.doctor,
            offload=list(self.options.offload),
            attempts=self.attempts,
            stages={k: self.stages[k] for k in SCHEME_STAGES if k in self.stages},
            seeds_added=self.seeds_added,
            seed_commands=self.seed_commands,
        )
        write_model(self.dir / CANDIDATE_FILE, candidate)

    def complete(self, stage: str, outputs: Sequence[Path], command: str | None = None) -> bool:
        """Done by an earlier run: ok, outputs present, nothing before it ran again and, when ``command``
        is given, made by the same command (so a changed option, --parity-db say, runs the stage again)."""
        previous = self.stages.get(stage)
        return (
            not self.dirty
            and previous is not None
            and previous.status == "ok"
            and all(p.exists() for p in outputs)
            and (command is None or previous.command == command)
        )

    def record(
        self,
        stage: str,
        status: Literal["ok", "failed", "skipped"],
        seconds: float,
        command: str | None,
        message: str | None,
    ) -> None:
        self.stages[stage] = StageEntry(
            status=status, seconds=round(seconds, 2), command=command, message=message
        )
        self.dirty = self.dirty or status != "skipped"  # a skipped stage changed nothing downstream
        self.save()


def plan_label(choices: Any) -> str:
    """A planned candidate's scheme as the report shows it: the schemes it mixes, e.g. ``fp8+w8a8+keep``."""
    present = set(choices)
    return "+".join(s for s in (*SCHEMES, KEEP) if s in present)


TICK_S = 10.0  # while a stage runs, a progress line at most this often (none is silent longer)


def run_logged(argv: list[str], log: Path, tick: Callable[[], None] | None = None) -> int:
    """``argv`` in a child process (``ditq.sweep.launch``), its output after the command line in ``log``; while it
    runs, ``tick`` every TICK_S seconds (a progress line)."""
    ((code, _),) = run_logged_beside([(argv, log, tick)])
    return code


def run_logged_beside(
    commands: Sequence[tuple[list[str], Path, Callable[[], None] | None]], poll_s: float = 0.2
) -> list[tuple[int, float]]:
    """Each (argv, log, tick) as ``run_logged`` runs one, all at once: once every one has ended, in order, each one's
    exit code and the seconds it ran (to ``poll_s``)."""
    children = []
    for argv, log, _ in commands:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as sink:
            sink.write(f"$ {shlex.join(argv)}\n".encode())
        children.append(launch.start(argv, log))
    codes: list[int | None] = [None] * len(children)
    started = time.monotonic()
    seconds = [0.0] * len(children)
    next_tick = started + TICK_S
    while None in codes:
        waiting = [i for i, code in enumerate(codes) if code is None]
        if len(waiting) == 1:  # one left: wait on it until the next tick
            with contextlib.suppress(subprocess.TimeoutExpired):
                codes[waiting[0]] = children[waiting[0]].wait(timeout=max(next_tick - time.monotonic(), 0.0))
        else:
            for i in waiting:
                codes[i] = children[i].poll()
            if None in codes:
                time.sleep(poll_s)
        for i in waiting:
            seconds[i] = time.monotonic() - started
        if None in codes and time.monotonic() >= next_tick:
            next_tick = time.monotonic() + TICK_S
            for (_, _, tick), code in zip(commands, codes, strict=True):
                if tick is not None and code is None:
                    tick()
    return [(int(code), time_s) for code, time_s in zip(codes, seconds, strict=True) if code is not None]


def probe_news(run_dir: Path, now: float | None = None) -> str | None:
    """How far the probe (or baseline) writing ``run_dir`` is: '5/16 requests, 1.9 s each, ETA 21 s', from its
    RUN.json (the requests this invocation planned) and the records it has appended; None before it has said.

    A request's time is the median of the warm ones (the first of an invocation compiles and warms caches: on a
    CPU it took many times the rest and made the ETA ten times too long), and the ETA counts down while the next
    request runs (``now``, Unix seconds; by default the clock), down to the remaining requests after it."""
    try:
        invocation = read_model(RunFile, run_dir / RUN_FILE).invocations[-1]
        lines = (run_dir / RECORDS_FILE).read_text(errors="replace").splitlines()
    except (OSError, InputError, IndexError):
        return None
    walls, last_end = [], None
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:  # the line being written
            continue
        if isinstance(record, dict) and record.get("invocation") == invocation.index:
            walls.append(float(record.get("wall_s") or 0.0))
            last_end = record.get("t_end") if isinstance(record.get("t_end"), (int, float)) else last_end
    done, planned = len(walls), invocation.planned
    if not done:
        return f"0/{planned} requests"
    each = statistics.median(walls[1:] if done > 1 else walls)
    running = 0.0 if last_end is None else min(max((now or time.time()) - last_end, 0.0), each)
    eta = max(max(planned - done, 0) * each - running, 0.0)
    return f"{done}/{planned} requests, {each:.1f} s each, ETA {eta:.0f} s"


def matrix_args(options: SweepOptions, seeds: str | None = None) -> list[str]:
    """The options the probe and the baseline share; ``seeds`` in place of the sweep's (--seeds auto)."""
    args = ["--fixtures", str(options.fixtures), "--refs", str(options.refs), "--no-progress"]
    seeds = seeds or (DEFAULT_SEEDS if options.seeds == "auto" else options.seeds)
    if seeds:
        args += ["--seeds", seeds]
    if options.steps is not None:
        args += ["--steps", str(options.steps)]
    if options.cfg is not None:
        args += ["--cfg", str(options.cfg)]
    if options.request_timeout_s is not None:
        args += ["--timeout", str(options.request_timeout_s)]
    return args


def seeds_by_fixture(run: Path) -> dict[str, list[int]]:
    """Per fixture, the seeds a run directory has records for."""
    out: dict[str, list[int]] = {}
    path = run / RECORDS_FILE
    for fixture_id, seed in sorted(latest_by_key(read_records(path)) if path.is_file() else {}):
        out.setdefault(fixture_id, []).append(seed)
    return out


def artifact_weight_bytes(artifact: Path, source: Path, variant: str | None) -> dict[str, WeightBytes]:
    """Per quantized component of the artifact: the bytes of its weight files and of the source's (``variant``)."""
    from ditq.checkpoint.layout import component_names, read_model_index, weight_files
    from ditq.runtime.loader import component_weight_files, is_quantized_component

    sizes = {}
    for component in component_names(read_model_index(artifact)):
        if (artifact / component / "config.json").is_file() and is_quantized_component(artifact, component):
            sizes[component] = WeightBytes(
                artifact=sum(p.stat().st_size for p in weight_files(artifact / component)),
                source=sum(p.stat().st_size for p in component_weight_files(source / component, variant)),
            )
    return sizes


def out_of_memory_keys(run_dir: Path) -> list[tuple[str, int]]:
    """The requests whose latest record ran out of accelerator memory (all of a run is none when nothing ran)."""
    if not (run_dir / RECORDS_FILE).is_file():
        return []
    return [key for key, record in latest_by_key(read_records(run_dir)).items() if is_out_of_memory(record)]


def unfinished_run(run_dir: Path) -> str | None:
    """Why a probe's run directory is not complete (a write error stopped it, say); None when it is."""
    problem = incomplete(run_dir)
    return None if problem is None else f"the run is not complete ({problem})"


def doctor_summary(doctor_json: Path, reports: Path) -> DoctorSummary:
    """From ``ditq doctor --json``'s file."""
    paths = read_model(DoctorFile, doctor_json).paths
    failing = [p.path for p in paths if p.verdict == "FAIL"]
    return DoctorSummary(passed=not failing, failing=failing, checked=len(paths), report=str(reports))
