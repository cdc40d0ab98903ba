"""`ditq sweep`: the main job. BF16 baseline, then per scheme quantize -> verify -> doctor -> serve ->
probe -> gate -> compare, then one report over all of them.

Every step is the step's own command, run as a subprocess with its output in ``OUT/<scheme>/logs/``,
so a crash in one step cannot take the sweep down and every number has the command behind it.

Offload ladder (``--offload auto,block``, what ``--offload auto`` means): each candidate, the baseline included,
is served at the first mode; the requests that did not fit its memory (503 ``out_of_memory``, or 413 ``over_memory_budget``
when the server's cost model refused them before they ran), or all of them when the
model did not even load (``ditq serve`` exit code 3), are sent again to a server at the next mode, and so on.
Every attempt is recorded (``CANDIDATE.json`` ``attempts``; ``logs/baseline-attempts.json``), and every record
says the offload it was served at, so the report shows which reference counts fit at which offload.
Layout::

    OUT/SWEEP.json                   options and the command that started the sweep (ditq.runfiles.SweepFile)
    OUT/baseline/                    sealed BF16 run (served under the same --max-memory)
    OUT/parity-in-process/           with --parity-in-process: the model run in process in bfloat16, sealed; with
                                     the baseline, the reference pair whose PSNR per seed is the parity band
    OUT/<scheme>/CANDIDATE.json      status, message, command and time of every stage
    OUT/<scheme>/artifact/           the quantized model
    OUT/<scheme>/run/                probe run: records, images, vram.csv, gate.json, compare.json
    OUT/plan/                        with --plan: the planned mixed-precision candidate, the same stages
                                     (quantize --plan), and a copy of its PLAN.json for the report
    OUT/report/                      REPORT.md, report.html, verdict.json

Resuming: a stage whose status is "ok" and whose outputs exist is skipped on a rerun; once one stage
runs again, the stages after it run again too. A stage that fails ends that scheme's chain and is its
verdict in the report; the other schemes go on.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TextIO

from ditq.compare import MAX_SEEDS, seeds_to_add
from ditq.devices import OFFLOAD_LADDER_AUTO, OFFLOAD_MODES, default_dtype
from ditq.errors import EXIT_OUT_OF_MEMORY, DitqError, InputError
from ditq.fsutil import atomic_write_bytes, sha256_file
from ditq.healthcheck import wait_healthy
from ditq.plan.schema import KEEP, PLAN_FILE, PlanFile, plan_bytes, read_plan
from ditq.probe.fixtures import DEFAULT_SEEDS, load_fixtures, parse_seeds, seeds_text
from ditq.probe.records import incomplete, is_out_of_memory, latest_by_key, read_records
from ditq.report import ReportResult, VerdictRules, build_report
from ditq.report.provenance import shell_command
from ditq.runfiles import (
    ATTEMPTS_FILE,
    BASELINE_COMMANDS_FILE,
    CANDIDATE_FILE,
    RECORDS_FILE,
    SWEEP_FILE,
    Attempt,
    CandidateFile,
    CommandList,
    CompareFile,
    DoctorFile,
    DoctorSummary,
    StageEntry,
    SweepFile,
    WeightBytes,
    read_model,
    write_model,
)
from ditq.schemes import SCHEMES, get_scheme

__all__ = [
    "PLAN_CANDIDATE",
    "SCHEME_STAGES",
    "SweepOptions",
    "default_serve_argv",
    "parse_endpoint_for",
    "parse_offload",
    "run_sweep",
]

SCHEME_STAGES = ("quantize", "verify", "doctor", "serve", "probe", "gate", "compare")
PLAN_CANDIDATE = "plan"  # the directory (and candidate name) of --plan's mixed-precision candidate

# (model or artifact dir, port, sweep options, offload mode) -> the server's argv; tests swap it for a
# server that fails
ServeArgv = Callable[[Path, int, "SweepOptions", str], list[str]]


def ditq_argv(*args: str | Path) -> list[str]:
    return [sys.executable, "-m", "ditq.cli", *(str(a) for a in args)]


def default_serve_argv(model: Path, port: int, options: SweepOptions, offload: str = "none") -> list[str]:
    # A collapsed image must come back (with a warning) so the gate can judge it: a 500 instead would
    # hide the very failure the sweep exists to show.
    argv = ditq_argv("serve", model, "--host", "127.0.0.1", "--port", str(port), "--on-collapse", "warn")
    argv += ["--device", options.device, "--offload", offload]
    argv += ["--dtype", options.dtype] if options.dtype else []
    argv += ["--variant", options.variant] if options.variant else []
    # quantized attention is the candidates' (the baseline is the model as it ships)
    argv += ["--attention", options.attention] if options.attention and model != options.model else []
    argv += ["--kv-cache", options.kv_cache] if options.kv_cache and model != options.model else []
    return argv + (["--max-memory", options.max_memory] if options.max_memory else [])


@dataclass(frozen=True)
class SweepOptions:
    model: Path
    schemes: tuple[str, ...]
    fixtures: Path
    refs: Path
    out: Path
    seeds: str | None = None  # as `ditq probe --seeds` reads it, or "auto"; None: the probe's default
    max_seeds: int = MAX_SEEDS  # --seeds auto: the most seeds a fixture may get
    steps: int | None = None
    cfg: float | None = None
    max_memory: str | None = None
    device: str = "cpu"  # where every server (and the doctor) runs, resolved: cpu, cuda, cuda:1, ...
    dtype: str | None = None  # the servers' compute dtype (None: ditq serve's default for the device)
    # the offload ladder: each mode serves what ran out of memory at the one before
    offload: tuple[str, ...] = ("none",)
    note: str | None = None  # said at the top of the report (e.g. that the weights are random)
    variant: str | None = None  # the model's weight files (fp16: *.fp16.safetensors); every step reads them
    endpoint_for: dict[str, str] = field(default_factory=dict)  # scheme -> URL of a server already running
    parity_db: float | None = None  # the parity band's PSNR (a BF16 reference pair's), stated
    parity_pair: tuple[Path, Path] | None = None  # two acceptable reference runs that span the band
    # the band from the baseline and the model run in process in bfloat16 (OUT/parity-in-process)
    parity_in_process: bool = False
    objective: Literal["fit", "speed", "memory"] = "fit"  # what the report's headline verdict answers
    health_timeout_s: float = 600.0
    request_timeout_s: float | None = None
    progress: bool = True
    plan: Path | None = None  # a PLAN.json (`ditq plan`): one more candidate, quantized with it
    # the PLAN.json read once, here (a bad plan is refused before anything runs); None without --plan
    plan_file: PlanFile | None = field(init=False, default=None, repr=False, compare=False)
    attention: str | None = None  # the candidates' servers' --attention (int8 | fp8); None: the model's own
    kv_cache: str | None = None  # the candidates' servers' --kv-cache (int8 | fp8); None: the model's own
    serve_argv: ServeArgv = default_serve_argv

    def __post_init__(self) -> None:
        if not self.schemes:
            raise InputError("--schemes: name at least one scheme (w8a16, w8a8, fp8)")
        unknown = set(self.endpoint_for) - set(self.schemes)
        if unknown:
            raise InputError(f"--endpoint-for: {sorted(unknown)[0]!r} is not one of the swept schemes")
        if sum((self.parity_db is not None, self.parity_pair is not None, self.parity_in_process)) > 1:
            raise InputError("--parity-db, --parity-pair and --parity-in-process: give one of them")
        if self.seeds == "auto":
            if self.parity_pair is not None:
                raise InputError(
                    "--seeds auto: the sweep cannot add seeds to --parity-pair's runs; "
                    "use --parity-db or --parity-in-process"
                )
            if self.parity_db is None and not self.parity_in_process:
                raise InputError(
                    "--seeds auto: needs a parity band to decide on (--parity-db or --parity-in-process)"
                )
            start = len(parse_seeds(DEFAULT_SEEDS))
            if self.max_seeds < start:
                raise InputError(
                    f"--max-seeds: at least {start} (the seeds --seeds auto starts from), got {self.max_seeds}"
                )
        unknown_modes = [m for m in self.offload if m not in OFFLOAD_MODES]
        if not self.offload or unknown_modes or len(set(self.offload)) != len(self.offload):
            raise InputError(
                f"--offload: {','.join(self.offload) or 'nothing'} is not a list of distinct modes "
                f"from {', '.join(OFFLOAD_MODES)} (e.g. none,model,block)"
            )
        for path, what in ((self.model, "model"), (self.fixtures, "--fixtures"), (self.refs, "--refs")):
            if not Path(path).exists():
                raise InputError(f"{what}: {path} does not exist")
        load_fixtures(self.fixtures, self.refs)  # every field and reference checked before a server starts
        if self.plan is not None:
            object.__setattr__(self, "plan_file", read_plan(self.plan))

    @property
    def candidates(self) -> tuple[str, ...]:
        """Every candidate's name (its directory): the schemes, then the plan's."""
        return (*self.schemes, *((PLAN_CANDIDATE,) if self.plan is not None else ()))


def parse_offload(value: str) -> tuple[str, ...]:
    """``--offload``: one mode, a comma list tried in order, or ``auto`` (the auto placement, then block)."""
    return (
        OFFLOAD_LADDER_AUTO
        if value.strip() == "auto"
        else tuple(m.strip() for m in value.split(",") if m.strip())
    )


def parse_endpoint_for(values: Sequence[str]) -> dict[str, str]:
    out = {}
    for value in values:
        scheme, sep, url = value.partition("=")
        if not sep or not url.startswith(("http://", "https://")):
            raise InputError(f"--endpoint-for {value!r}: expected SCHEME=http://HOST:PORT")
        out[get_scheme(scheme.strip()).name] = url.rstrip("/")
    return out


class _Progress:
    """One display for the whole sweep: a line per stage, counted against the total."""

    def __init__(self, total: int, enabled: bool, stream: TextIO = sys.stderr) -> None:
        self.total, self.done, self.enabled, self.stream = total, 0, enabled, stream
        self.started = time.monotonic()

    def __call__(self, who: str, stage: str, status: str, detail: str = "") -> None:
        if status != "running":
            self.done += 1
            self.total = max(self.total, self.done)  # --seeds auto adds stages as it goes
        if self.enabled:
            clock = time.monotonic() - self.started
            line = f"[{self.done:>2}/{self.total}] {clock:6.0f}s  {who:<9} {stage:<9} {status}"
            print(line + (f": {detail}" if detail else ""), file=self.stream, flush=True)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _last_line(log: Path) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no output"


class _Server:
    """A server subprocess on a free loopback port, healthy (/health 200) or stopped and explained."""

    def __init__(self, options: SweepOptions, model: Path, log: Path, offload: str = "none") -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.offload = offload
        self.argv = options.serve_argv(model, self.port, options, offload)
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as sink:
            self.process = subprocess.Popen(self.argv, stdout=sink, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout_s: float) -> str | None:
        """None once /health answers 200; otherwise why not (and the server is stopped)."""
        problem = wait_healthy(self.url, timeout_s, self.process)
        if problem is None:
            return None
        if self.process.poll() is not None:
            return f"{problem} ({_last_line(self.log)})"
        self.stop()
        return problem

    @property
    def out_of_memory_at_load(self) -> bool:
        """The server stopped because the model did not fit in the memory it may use."""
        return self.process.poll() == EXIT_OUT_OF_MEMORY

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # drains in-flight work, then exits
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


class _Candidate:
    """One scheme's directory and CANDIDATE.json, rewritten (atomically) after every stage."""

    def __init__(self, options: SweepOptions, scheme: str) -> None:
        self.options, self.scheme = options, scheme
        self.plan = options.plan_file if scheme == PLAN_CANDIDATE else None
        self.dir = options.out / scheme
        self.artifact, self.run_dir, self.logs = self.dir / "artifact", self.dir / "run", self.dir / "logs"
        path = self.dir / CANDIDATE_FILE
        previous = read_model(CandidateFile, path) if path.is_file() else CandidateFile(name=scheme)
        self.stages: dict[str, StageEntry] = dict(previous.stages)
        self.doctor: DoctorSummary | None = previous.doctor
        self.attempts: list[Attempt] = list(previous.attempts)  # the offload ladder
        self.seeds_added: dict[str, int] = dict(previous.seeds_added)  # --seeds auto
        self.seed_commands: list[str] = list(previous.seed_commands)  # the commands that added them
        self.dirty = False  # a stage ran in this sweep: every later stage runs again
        self.reached: set[str] = set()  # stages this sweep got to (the rest follow a failure)

    def save(self) -> None:
        manifest = self.artifact / "MANIFEST.json"
        weight_bytes = (
            _weight_bytes(self.artifact, self.options.model, self.options.variant)
            if manifest.is_file()
            else None
        )
        candidate = CandidateFile(
            name=self.scheme,
            scheme=self.scheme if self.plan is None else _plan_label(self.plan.layers.values()),
            artifact=str(self.artifact),
            artifact_digest=sha256_file(manifest) if manifest.is_file() else None,
            weight_bytes=weight_bytes,
            max_memory=self.options.max_memory,
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


def _plan_label(choices: Any) -> str:
    """A planned candidate's scheme as the report shows it: the schemes it mixes, e.g. ``fp8+w8a8+keep``."""
    present = set(choices)
    return "+".join(s for s in (*SCHEMES, KEEP) if s in present)


def _run_logged(argv: list[str], log: Path) -> int:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as sink:
        sink.write(f"$ {shlex.join(argv)}\n".encode())
        sink.flush()
        return subprocess.run(argv, stdout=sink, stderr=subprocess.STDOUT, check=False).returncode


def _matrix_args(options: SweepOptions, seeds: str | None = None) -> list[str]:
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


def _seeds_by_fixture(run: Path) -> dict[str, list[int]]:
    """Per fixture, the seeds a run directory has records for."""
    out: dict[str, list[int]] = {}
    path = run / RECORDS_FILE
    for fixture_id, seed in sorted(latest_by_key(read_records(path)) if path.is_file() else {}):
        out.setdefault(fixture_id, []).append(seed)
    return out


def _weight_bytes(artifact: Path, source: Path, variant: str | None) -> dict[str, WeightBytes]:
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


def _out_of_memory_keys(run_dir: Path) -> list[tuple[str, int]]:
    """The requests whose latest record ran out of accelerator memory (all of a run is none when nothing ran)."""
    if not (run_dir / RECORDS_FILE).is_file():
        return []
    return [key for key, record in latest_by_key(read_records(run_dir)).items() if is_out_of_memory(record)]


def _unfinished_run(run_dir: Path) -> str | None:
    """Why a probe's run directory is not complete (a write error stopped it, say); None when it is."""
    problem = incomplete(run_dir)
    return None if problem is None else f"the run is not complete ({problem})"


def _doctor_summary(doctor_json: Path, reports: Path) -> DoctorSummary:
    """From ``ditq doctor --json``'s file."""
    paths = read_model(DoctorFile, doctor_json).paths
    failing = [p.path for p in paths if p.verdict == "FAIL"]
    return DoctorSummary(passed=not failing, failing=failing, checked=len(paths), report=str(reports))


class _Sweep:
    def __init__(self, options: SweepOptions, command: str) -> None:
        self.options, self.command = options, command
        self.out = options.out
        self.baseline = self.out / "baseline"
        self.parity_run = self.out / "parity-in-process"
        # the baseline is BF16 unless the servers compute in another dtype (float32 on a CPU, say)
        dtype = options.dtype or default_dtype(options.device)
        self.baseline_name = "BF16" if dtype == "bfloat16" else dtype
        runs = 1 + options.parity_in_process
        self.progress = _Progress(runs + len(SCHEME_STAGES) * len(options.candidates) + 1, options.progress)

    def _show(self, c: _Candidate, stage: str, status: str, detail: str = "") -> None:
        if status != "running":
            c.reached.add(stage)
        self.progress(c.scheme, stage, status, detail)

    # -- one stage: skip when complete, else run its command and record what happened ----------------
    def _step(
        self,
        c: _Candidate,
        stage: str,
        argv: list[str],
        outputs: Sequence[Path],
        ok_codes: tuple[int, ...] = (0,),
        unfinished: Callable[[], str | None] = lambda: None,  # why the outputs are not whole (None: they are)
    ) -> bool:
        if c.complete(stage, outputs, shell_command(argv)):
            self._show(c, stage, "skipped", "complete from an earlier run")
            return True
        self._show(c, stage, "running")
        log = c.logs / f"{stage}.log"
        started = time.monotonic()
        code = _run_logged(argv, log)
        ok = code in ok_codes and all(p.exists() for p in outputs)
        message = None if ok else f"exit code {code}: {_last_line(log)}"
        if ok and (problem := unfinished()) is not None:
            ok, message = False, f"exit code {code}, {problem}: {_last_line(log)}"
        c.record(stage, "ok" if ok else "failed", time.monotonic() - started, shell_command(argv), message)
        self._show(c, stage, "ok" if ok else "FAILED", message or f"{time.monotonic() - started:.1f} s")
        return ok

    # -- the BF16 baseline: required; without it nothing can be judged -------------------------------
    def run_baseline(self) -> bool:
        from ditq.baseline import verify_seal

        seal = self.baseline / "SEAL.json"
        if seal.is_file() and not verify_seal(self.baseline):
            self.progress(self.baseline_name, "baseline", "skipped", "sealed by an earlier run")
            return False
        self.progress(self.baseline_name, "baseline", "running")
        started = time.monotonic()
        logs = self.out / "logs"

        attempts, failure = self._serve_ladder(
            self.options.model, self.baseline, logs, "baseline", self._baseline_argv(), logs / "baseline.log"
        )
        write_model(logs / ATTEMPTS_FILE, attempts)
        commands = [c for a in attempts for c in (a.command, a.probe_command) if c]
        write_model(logs / BASELINE_COMMANDS_FILE, CommandList(commands))
        if failure is not None or not seal.is_file():
            raise DitqError(f"baseline: {failure or 'no sealed baseline'} (log: {logs / 'baseline.log'})")
        self.progress(self.baseline_name, "baseline", "ok", f"{time.monotonic() - started:.1f} s")
        return True

    def _baseline_argv(
        self, seeds: str | None = None, only: Sequence[str] = ()
    ) -> Callable[[_Server, bool], list[str]]:
        """``ditq baseline`` through a server; ``seeds`` and ``only`` where --seeds auto adds seeds."""

        def argv(server: _Server, retry: bool) -> list[str]:
            out = ditq_argv("baseline", self.options.model, "--endpoint", server.url, "--out", self.baseline)
            out += [*_matrix_args(self.options, seeds), *(["--only", ",".join(only)] if only else [])]
            out += ["--server-pid", str(server.process.pid)]
            return out + (["--retry-out-of-memory"] if retry else [])

        return argv

    # -- the reference pair's second run: the model in process in bfloat16 ----------------------------------
    def run_parity_pair(self) -> None:
        from ditq.baseline import verify_seal

        if (self.parity_run / "SEAL.json").is_file() and not verify_seal(self.parity_run):
            self.progress("bfloat16", "pair", "skipped", "sealed by an earlier run")
            return
        self._pair_run()

    def _pair_run(self, seeds: str | None = None, only: Sequence[str] = ()) -> None:
        self.progress("bfloat16", "pair", "running")
        started = time.monotonic()
        argv = ditq_argv(
            "baseline", self.options.model, "--out", self.parity_run, *_matrix_args(self.options, seeds)
        )
        argv += ["--only", ",".join(only)] if only else []
        log = self.out / "logs" / "parity-in-process.log"
        argv += ["--device", self.options.device]
        argv += ["--variant", self.options.variant] if self.options.variant else []
        code = _run_logged(argv, log)
        self._add_baseline_commands([shell_command(argv)])
        if code != 0 or not (self.parity_run / "SEAL.json").is_file():
            raise DitqError(f"the reference pair's in-process run failed: exit code {code} (log: {log})")
        self.progress("bfloat16", "pair", "ok", f"{time.monotonic() - started:.1f} s")

    @property
    def parity_args(self) -> list[str]:
        """compare's parity band options."""
        if self.options.parity_db is not None:
            return ["--parity-db", str(self.options.parity_db)]
        if self.options.parity_pair is not None:
            return ["--parity-pair", *(str(p) for p in self.options.parity_pair)]
        if self.options.parity_in_process:
            return ["--parity-pair", str(self.baseline), str(self.parity_run)]
        return []

    # -- serving through the offload ladder ------------------------------------------------------------
    def _serve_ladder(
        self,
        model: Path,
        run_dir: Path,
        logs: Path,
        who: str,
        probe_argv: Callable[[_Server, bool], list[str]],
        probe_log: Path,
    ) -> tuple[list[Attempt], str | None]:
        """Serve ``model`` at each offload mode in turn until nothing ran out of memory; probe each server.

        Returns every attempt (offload, status, seconds, the server's and the probe's commands, requests
        still out of memory after it) and why the ladder stopped short (None: it did not).
        """
        attempts: list[Attempt] = []
        for rung, offload in enumerate(self.options.offload):
            started = time.monotonic()
            suffix = "" if len(self.options.offload) == 1 else f"-{offload}"
            log = logs / (f"serve-baseline{suffix}.log" if who == "baseline" else f"serve{suffix}.log")
            server = _Server(self.options, model, log, offload)
            attempt: dict[str, Any] = {"offload": offload, "command": shell_command(server.argv)}
            problem = server.wait_healthy(self.options.health_timeout_s)
            if problem is not None:
                attempt.update(seconds=round(time.monotonic() - started, 2), message=problem)
                if server.out_of_memory_at_load:
                    attempts.append(Attempt(**attempt, status="out_of_memory_at_load"))
                    self.progress(who, "serve", "out of memory", f"offload {offload}: the model did not load")
                    continue
                attempts.append(Attempt(**attempt, status="failed"))
                return attempts, problem
            ready_s = round(time.monotonic() - started, 2)
            self.progress(who, "serve", "ok", f"offload {offload}, {server.url}")
            try:
                argv = probe_argv(server, rung > 0)
                code = _run_logged(argv, probe_log)
            finally:
                server.stop()
            remaining = _out_of_memory_keys(run_dir)
            unfinished = _unfinished_run(run_dir) if code in (0, 1) else None
            attempts.append(
                Attempt(
                    **attempt,
                    ready_s=ready_s,
                    status="ok" if code in (0, 1) and unfinished is None else "failed",
                    seconds=round(time.monotonic() - started, 2),
                    probe_command=shell_command(argv),
                    exit_code=code,
                    out_of_memory_after=len(remaining),
                )
            )
            if code not in (0, 1):
                return attempts, f"exit code {code}: {_last_line(probe_log)}"
            if unfinished is not None:
                return attempts, f"exit code {code}, {unfinished}: {_last_line(probe_log)}"
            if not remaining:
                break
            self.progress(who, "probe", "out of memory", f"{len(remaining)} requests at offload {offload}")
        return attempts, None

    # -- one scheme ----------------------------------------------------------------------------------
    def run_scheme(self, scheme: str, baseline_ran: bool) -> None:
        c = _Candidate(self.options, scheme)
        if baseline_ran:  # gate and compare read the baseline: a new baseline means new judgments
            for stage in ("gate", "compare"):
                c.stages.pop(stage, None)
        c.save()
        options = self.options
        manifest = c.artifact / "MANIFEST.json"
        # --force: an artifact left by an interrupted or older run is replaced (quantize writes atomically)
        if c.plan is not None:
            # a copy beside the candidate: what quantize reads and the report shows are the same file
            c.dir.mkdir(parents=True, exist_ok=True)
            copy, fresh = c.dir / PLAN_FILE, plan_bytes(c.plan)
            if copy.is_file() and copy.read_bytes() != fresh:
                c.dirty = True  # another plan than the one an earlier run quantized: every stage runs again
            atomic_write_bytes(copy, fresh)
            quantize = ditq_argv(
                "quantize", options.model, c.artifact, "--plan", c.dir / PLAN_FILE, "--force"
            )
        else:
            quantize = ditq_argv("quantize", options.model, c.artifact, "--scheme", scheme, "--force")
        quantize += ["--device", options.device]  # the device the servers use encodes fastest
        quantize += ["--variant", options.variant] if options.variant else []
        chain_ok = self._step(c, "quantize", quantize, [manifest])
        chain_ok = chain_ok and self._step(
            c, "verify", ditq_argv("verify", c.artifact, "--source", options.model), []
        )
        if chain_ok:
            # A failing kernel path is a finding, not the end of the chain: the server falls back to a path
            # that passed, the numbers show what that gives, and the verdict carries the doctor's finding.
            doctor_json, reports = c.dir / "doctor.json", c.dir / "doctor-reports"
            only = [] if c.plan is not None else ["--scheme", scheme]  # a plan's: every scheme it holds
            doctor = ditq_argv("doctor", "--artifact", c.artifact, *only, "--device", options.device)
            doctor += ["--json", str(doctor_json)]
            chain_ok = self._step(c, "doctor", [*doctor, "--report", str(reports)], [doctor_json], (0, 1))
            if chain_ok and c.stages["doctor"].status == "ok":
                c.doctor = _doctor_summary(doctor_json, reports)
                c.save()
        chain_ok = chain_ok and self._serve_and_probe(c)
        if chain_ok:
            self._gate_and_compare(c)
        for stage in SCHEME_STAGES:
            if stage not in c.reached:  # after a failure: say so, and drop what an earlier run left
                c.stages.pop(stage, None)
                self._show(c, stage, "not reached", "an earlier stage failed")
        c.save()

    def _gate_and_compare(self, c: _Candidate) -> None:
        gate_json, compare_json = c.run_dir / "gate.json", c.run_dir / "compare.json"
        gate = ditq_argv("gate", c.run_dir, "--baseline", self.baseline)
        if self._step(c, "gate", gate, [gate_json], (0, 1)):
            compare = ditq_argv(
                "compare", c.run_dir, "--baseline", self.baseline, "--no-lpips", *self.parity_args
            )
            self._step(c, "compare", compare, [compare_json], (0, 1))

    # -- --seeds auto: more seeds for the fixtures a compare left undecided ----------------------------
    def settle_seeds(self) -> dict[str, list[int]]:
        """Round after round, give every fixture that some candidate's compare left undecided about as many
        seeds as that compare said would settle it (at least one more, at most --max-seeds): the baseline, the
        in-process pair and every judged candidate probe the new seeds of those fixtures only (``--only``),
        then gate and compare run again. A fixture's seeds are shared by every run, so that every PSNR stays
        paired. Stops when no fixture is undecided or every undecided one is at the cap. Returns the seeds
        each fixture was run at."""
        start, cap = parse_seeds(DEFAULT_SEEDS), self.options.max_seeds
        while True:
            current = _seeds_by_fixture(self.baseline)
            targets = self._seed_targets(current, cap)
            if not targets:
                return current
            groups: dict[int, list[str]] = {}
            for fixture_id, target in targets.items():
                groups.setdefault(target, []).append(fixture_id)
            plan = [
                (seeds_text([*start, *range(max(start) + 1, max(start) + 1 + target - len(start))]), ids)
                for target, ids in sorted(groups.items())
            ]
            for seeds, fixture_ids in plan:
                self.progress("all", "seeds", "ok", f"{', '.join(fixture_ids)}: seeds {seeds}")
                self._extend_baseline(seeds, fixture_ids)
                if self.options.parity_in_process:
                    self._pair_run(seeds, fixture_ids)
            for scheme in self.options.candidates:
                self._extend_candidate(_Candidate(self.options, scheme), plan, len(start))

    def _judged(self) -> list[tuple[str, CompareFile]]:
        """The candidates whose compare ran, with its result."""
        out = []
        for scheme in self.options.candidates:
            c = _Candidate(self.options, scheme)
            compare = c.stages.get("compare")
            path = c.run_dir / "compare.json"
            if compare is not None and compare.status == "ok" and path.is_file():
                out.append((scheme, read_model(CompareFile, path)))
        return out

    def _seed_targets(self, current: dict[str, list[int]], cap: int) -> dict[str, int]:
        """Fixture -> the seeds it should have, for every fixture some compare left undecided below the cap."""
        targets: dict[str, int] = {}
        for _, compare in self._judged():
            for fixture_id, entry in compare.fixtures.items():
                have = current.get(fixture_id, [])
                more = seeds_to_add(entry.parity, have, cap)
                if more:
                    targets[fixture_id] = max(targets.get(fixture_id, 0), len(have) + len(more))
        return targets

    def _extend_baseline(self, seeds: str, fixture_ids: list[str]) -> None:
        have = _seeds_by_fixture(self.baseline)
        if all(set(parse_seeds(seeds)) <= set(have.get(f, [])) for f in fixture_ids):
            return
        self.progress(
            self.baseline_name, "baseline", "running", f"seeds {seeds} for {', '.join(fixture_ids)}"
        )
        logs = self.out / "logs"
        attempts, failure = self._serve_ladder(
            self.options.model,
            self.baseline,
            logs,
            "baseline",
            self._baseline_argv(seeds, fixture_ids),
            logs / "baseline.log",
        )  # ``ditq baseline`` seals the run again over the added records and images
        self._add_baseline_commands([c for a in attempts for c in (a.command, a.probe_command) if c])
        if failure is not None or not (self.baseline / "SEAL.json").is_file():
            raise DitqError(f"baseline: {failure or 'no sealed baseline'} (log: {logs / 'baseline.log'})")
        self.progress(self.baseline_name, "baseline", "ok", f"seeds {seeds} for {', '.join(fixture_ids)}")

    def _add_baseline_commands(self, commands: list[str]) -> None:
        """After the ones ``logs/baseline-commands.json`` holds: the report lists them behind the baseline."""
        path = self.out / "logs" / BASELINE_COMMANDS_FILE
        earlier = read_model(CommandList, path).root if path.is_file() else []
        write_model(path, CommandList([*earlier, *commands]))

    def _extend_candidate(self, c: _Candidate, plan: list[tuple[str, list[str]]], started_with: int) -> None:
        compare = c.stages.get("compare")
        if compare is None or compare.status != "ok":
            return  # not judged: nothing to settle
        for seeds, fixture_ids in plan:
            have = _seeds_by_fixture(c.run_dir)
            wanted = set(parse_seeds(seeds))
            missing = [f for f in fixture_ids if not wanted <= set(have.get(f, []))]
            if not missing:
                continue
            self._show(c, "probe", "running", f"seeds {seeds} for {', '.join(missing)}")
            begun = time.monotonic()
            matrix = [*_matrix_args(self.options, seeds), "--only", ",".join(missing)]
            endpoint = self.options.endpoint_for.get(c.scheme)
            if endpoint is not None:
                argv = ditq_argv("probe", "--endpoint", endpoint, "--out", c.run_dir, *matrix)
                code = _run_logged(argv, c.logs / "probe.log")
                c.seed_commands.append(shell_command(argv))
                failure = None if code in (0, 1) else f"exit code {code}: {_last_line(c.logs / 'probe.log')}"
                failure = failure or _unfinished_run(c.run_dir)
            else:

                def probe_argv(server: _Server, retry: bool, matrix: list[str] = matrix) -> list[str]:
                    argv = ditq_argv("probe", "--endpoint", server.url, "--out", c.run_dir, *matrix)
                    argv += ["--server-pid", str(server.process.pid)]
                    return argv + (["--retry-out-of-memory"] if retry else [])

                attempts, failure = self._serve_ladder(
                    c.artifact, c.run_dir, c.logs, c.scheme, probe_argv, c.logs / "probe.log"
                )
                c.seed_commands += [cmd for a in attempts for cmd in (a.command, a.probe_command) if cmd]
            for fixture_id in missing:
                c.seeds_added[fixture_id] = len(wanted) - started_with
            if failure is not None:
                c.stages.pop("gate", None)
                c.stages.pop("compare", None)
                c.record(
                    "probe", "failed", time.monotonic() - begun, None, f"adding seeds {seeds}: {failure}"
                )
                self._show(c, "probe", "FAILED", failure)
                return
            self._show(c, "probe", "ok", f"seeds {seeds} for {', '.join(missing)}")
        c.stages.pop("gate", None)  # the baseline and the run have more seeds: judge them again
        c.stages.pop("compare", None)
        c.save()
        self._gate_and_compare(c)

    def _serve_and_probe(self, c: _Candidate) -> bool:
        records = c.run_dir / "records.jsonl"
        if c.complete("probe", [records]):
            self._show(c, "serve", "skipped", "the probe is complete")
            self._show(c, "probe", "skipped", "complete from an earlier run")
            return True
        if c.dirty and c.run_dir.exists():
            # an earlier stage ran again (a new artifact): the old images are not this artifact's, so start
            # over; otherwise an unfinished probe (a killed sweep) resumes where it stopped
            shutil.rmtree(c.run_dir)
            c.seeds_added, c.seed_commands = {}, []
        endpoint = self.options.endpoint_for.get(c.scheme)
        if endpoint is not None:
            c.record("serve", "skipped", 0.0, None, f"probed through {endpoint}")
            self._show(c, "serve", "skipped", f"probed through {endpoint}")
            probe = ditq_argv(
                "probe", "--endpoint", endpoint, "--out", c.run_dir, *_matrix_args(self.options)
            )
            return self._step(c, "probe", probe, [records], (0, 1), lambda: _unfinished_run(c.run_dir))

        def probe_argv(server: _Server, retry: bool) -> list[str]:
            argv = ditq_argv(
                "probe", "--endpoint", server.url, "--out", c.run_dir, *_matrix_args(self.options)
            )
            argv += ["--server-pid", str(server.process.pid)]  # the sampler measures this process's memory
            return argv + (["--retry-out-of-memory"] if retry else [])

        self._show(c, "serve", "running")
        started = time.monotonic()
        attempts, failure = self._serve_ladder(
            c.artifact, c.run_dir, c.logs, c.scheme, probe_argv, c.logs / "probe.log"
        )
        c.attempts = attempts
        served = [a for a in attempts if a.loaded]
        serve_failure = (
            None if served else failure or "; ".join(f"offload {a.offload}: {a.message}" for a in attempts)
        )
        seconds = time.monotonic() - started
        ready = sum(a.ready_s if a.ready_s is not None else a.seconds or 0.0 for a in attempts)
        c.record(
            "serve",
            "failed" if serve_failure else "ok",
            ready,
            attempts[-1].command if attempts else None,
            serve_failure,
        )
        self._show(
            c,
            "serve",
            "FAILED" if serve_failure else "ok",
            serve_failure or ", ".join(a.offload for a in served),
        )
        if serve_failure:
            return False
        ok = failure is None and records.exists()
        c.record("probe", "ok" if ok else "failed", seconds, served[-1].probe_command, failure)
        self._show(c, "probe", "ok" if ok else "FAILED", failure or f"{seconds:.1f} s")
        return ok

    def report(self) -> ReportResult:
        self.progress("all", "report", "running")
        attempts = self.out / "logs" / ATTEMPTS_FILE
        commands = self.out / "logs" / BASELINE_COMMANDS_FILE
        result = build_report(
            [self.out / scheme for scheme in self.options.candidates],
            self.baseline,
            self.out / "report",
            VerdictRules(parity_reference_db=self.options.parity_db, objective=self.options.objective),
            command=self.command,
            baseline_commands=read_model(CommandList, commands).root if commands.is_file() else [],
            baseline_name=self.baseline_name,
            baseline_memory_budget=self.options.max_memory,
            baseline_attempts=attempts if attempts.is_file() else None,
            note=self.options.note,
        )
        self.progress("all", "report", "ok", str(result.html))
        return result


def model_fingerprint(model: Path) -> dict[str, list[int]]:
    """Every file of the model directory -> [size, mtime_ns]: what a sweep's finished stages were made from."""
    stats = {str(path.relative_to(model)): path.stat() for path in sorted(model.rglob("*")) if path.is_file()}
    return {name: [stat.st_size, stat.st_mtime_ns] for name, stat in stats.items()}


def check_same_model(out: Path, fingerprint: dict[str, list[int]]) -> None:
    """Refuse to resume a sweep whose finished stages were made from other model files: its baseline and artifacts
    would be stale (a re-trained or re-downloaded model in the same place, say)."""
    path = out / SWEEP_FILE
    earlier = read_model(SweepFile, path).model_fingerprint if path.is_file() else None
    if earlier is None or earlier == fingerprint:
        return  # a new sweep, one whose model is unchanged, or one from before fingerprints (cannot tell)
    changed = sorted(
        name for name in set(earlier) | set(fingerprint) if earlier.get(name) != fingerprint.get(name)
    )
    shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
    raise InputError(
        f"{out}: made by an earlier sweep from other model files ({shown} changed since); "
        "remove it or choose another --out"
    )


def run_sweep(options: SweepOptions, command: str | None = None) -> ReportResult:
    """Run (or resume) the whole sweep and return its report."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per /health poll is noise
    fingerprint = model_fingerprint(options.model)
    check_same_model(options.out, fingerprint)
    options.out.mkdir(parents=True, exist_ok=True)
    command = command or shell_command()
    sweep_file = SweepFile(
        command=command,
        model=str(options.model),
        model_fingerprint=fingerprint,
        schemes=list(options.schemes),
        fixtures=str(options.fixtures),
        refs=str(options.refs),
        seeds=options.seeds,
        steps=options.steps,
        max_memory=options.max_memory,
        offload=list(options.offload),
        note=options.note,
        variant=options.variant,
        device=options.device,
        dtype=options.dtype,
        endpoint_for=options.endpoint_for,
        parity_db=options.parity_db,
        parity_pair=[str(p) for p in options.parity_pair] if options.parity_pair else None,
        parity_in_process=options.parity_in_process,
        max_seeds=options.max_seeds if options.seeds == "auto" else None,
        plan=None if options.plan is None else str(options.plan),
        attention=options.attention,
        kv_cache=options.kv_cache,
        pid=os.getpid(),
    )
    write_model(options.out / SWEEP_FILE, sweep_file)
    sweep = _Sweep(options, command)
    baseline_ran = sweep.run_baseline()
    if options.parity_in_process:
        sweep.run_parity_pair()
    for scheme in options.candidates:
        sweep.run_scheme(scheme, baseline_ran)
    if options.seeds == "auto":
        seeds = sweep.settle_seeds()
        by_fixture = {fixture_id: seeds_text(s) for fixture_id, s in seeds.items()}
        write_model(options.out / SWEEP_FILE, sweep_file.model_copy(update={"seeds_by_fixture": by_fixture}))
    return sweep.report()
