"""`ditq sweep`: the main job. BF16 baseline, then per scheme quantize -> verify -> doctor -> serve ->
probe -> gate -> compare, then one report over all of them.

Every step is the step's own command, run as a subprocess with its output in ``OUT/<scheme>/logs/``,
so a crash in one step cannot take the sweep down and every number has the command behind it.
Layout::

    OUT/SWEEP.json                   options and the command that started the sweep
    OUT/baseline/                    sealed BF16 run (served under the same --max-memory)
    OUT/<scheme>/CANDIDATE.json      status, message, command and time of every stage
    OUT/<scheme>/artifact/           the quantized model
    OUT/<scheme>/run/                probe run: records, images, vram.csv, gate.json, compare.json
    OUT/report/                      REPORT.md, report.html, verdict.json

Resuming: a stage whose status is "ok" and whose outputs exist is skipped on a rerun; once one stage
runs again, the stages after it run again too. A stage that fails ends that scheme's chain and is its
verdict in the report; the other schemes go on.
"""

from __future__ import annotations

import json
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
from typing import Any, TextIO

from ditq.cli import COMMANDS
from ditq.errors import DitqError, InputError
from ditq.fsutil import atomic_write_json, sha256_file
from ditq.healthcheck import wait_healthy
from ditq.report import ReportResult, VerdictRules, build_report
from ditq.report.model import CANDIDATE_FILE
from ditq.report.provenance import shell_command
from ditq.schemes import get_scheme

__all__ = [
    "SCHEME_STAGES",
    "SweepOptions",
    "default_device",
    "default_serve_argv",
    "parse_endpoint_for",
    "run_sweep",
]

SCHEME_STAGES = ("quantize", "verify", "doctor", "serve", "probe", "gate", "compare")

# (model or artifact dir, port, sweep options) -> the server's argv; tests swap it for a server that fails
ServeArgv = Callable[[Path, int, "SweepOptions"], list[str]]


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def ditq_argv(*args: str | Path) -> list[str]:
    return [sys.executable, "-m", "ditq.cli", *(str(a) for a in args)]


def default_serve_argv(model: Path, port: int, options: SweepOptions) -> list[str]:
    # A collapsed image must come back (with a warning) so the gate can judge it: a 500 instead would
    # hide the very failure the sweep exists to show.
    argv = ditq_argv("serve", model, "--host", "127.0.0.1", "--port", str(port), "--on-collapse", "warn")
    argv += ["--device", options.device]
    argv += ["--dtype", options.dtype] if options.dtype else []
    return argv + (["--max-memory", options.max_memory] if options.max_memory else [])


@dataclass(frozen=True)
class SweepOptions:
    model: Path
    schemes: tuple[str, ...]
    fixtures: Path
    refs: Path
    out: Path
    seeds: str | None = None  # as `ditq probe --seeds` reads it; None: the probe's default
    steps: int | None = None
    cfg: float | None = None
    max_memory: str | None = None
    device: str = "cpu"  # where every server (and the doctor) runs: cpu, cuda, cuda:1, ...
    dtype: str | None = None  # the servers' compute dtype (None: ditq serve's default, bfloat16)
    endpoint_for: dict[str, str] = field(default_factory=dict)  # scheme -> URL of a server already running
    parity_db: float | None = None  # the parity band's PSNR (a BF16 reference pair's), stated
    parity_pair: tuple[Path, Path] | None = None  # two acceptable reference runs that span the band
    health_timeout_s: float = 600.0
    request_timeout_s: float | None = None
    progress: bool = True
    serve_argv: ServeArgv = default_serve_argv

    def __post_init__(self) -> None:
        if not self.schemes:
            raise InputError("--schemes: name at least one scheme (w8a16, w8a8, fp8)")
        unknown = set(self.endpoint_for) - set(self.schemes)
        if unknown:
            raise InputError(f"--endpoint-for: {sorted(unknown)[0]!r} is not one of the swept schemes")
        if self.parity_db is not None and self.parity_pair is not None:
            raise InputError("--parity-db and --parity-pair: give one of them")
        for path, what in ((self.model, "model"), (self.fixtures, "--fixtures"), (self.refs, "--refs")):
            if not Path(path).exists():
                raise InputError(f"{what}: {path} does not exist")


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

    def __init__(self, options: SweepOptions, model: Path, log: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = options.serve_argv(model, self.port, options)
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
        self.dir = options.out / scheme
        self.artifact, self.run_dir, self.logs = self.dir / "artifact", self.dir / "run", self.dir / "logs"
        path = self.dir / CANDIDATE_FILE
        previous = _read_json(path) if path.is_file() else {}
        self.stages: dict[str, dict[str, Any]] = dict(previous.get("stages") or {})
        self.doctor: dict[str, Any] | None = previous.get("doctor")
        self.dirty = False  # a stage ran in this sweep: every later stage runs again
        self.reached: set[str] = set()  # stages this sweep got to (the rest follow a failure)

    def save(self) -> None:
        manifest = self.artifact / "MANIFEST.json"
        atomic_write_json(
            self.dir / CANDIDATE_FILE,
            {
                "name": self.scheme,
                "scheme": self.scheme,
                "artifact": str(self.artifact),
                "artifact_digest": sha256_file(manifest) if manifest.is_file() else None,
                "max_memory": self.options.max_memory,
                "endpoint": self.options.endpoint_for.get(self.scheme),
                "run": "run",
                "doctor": self.doctor,
                "stages": {k: self.stages[k] for k in SCHEME_STAGES if k in self.stages},
            },
        )

    def complete(self, stage: str, outputs: Sequence[Path], command: str | None = None) -> bool:
        """Done by an earlier run: ok, outputs present, nothing before it ran again and, when ``command``
        is given, made by the same command (so a changed option, --parity-db say, runs the stage again)."""
        previous = self.stages.get(stage, {})
        return (
            not self.dirty
            and previous.get("status") == "ok"
            and all(p.exists() for p in outputs)
            and (command is None or previous.get("command") == command)
        )

    def record(
        self, stage: str, status: str, seconds: float, command: str | None, message: str | None
    ) -> None:
        self.stages[stage] = {
            "status": status,
            "seconds": round(seconds, 2),
            "command": command,
            "message": message,
        }
        self.dirty = self.dirty or status != "skipped"  # a skipped stage changed nothing downstream
        self.save()


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError:
        return {}  # a torn file from a killed run: the stages simply run again
    return data if isinstance(data, dict) else {}


def _read_json_list(path: Path) -> list[str]:
    try:
        data = json.loads(path.read_text()) if path.is_file() else []
    except json.JSONDecodeError:
        return []
    return [str(item) for item in data] if isinstance(data, list) else []


def _run_logged(argv: list[str], log: Path) -> int:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as sink:
        sink.write(f"$ {shlex.join(argv)}\n".encode())
        sink.flush()
        return subprocess.run(argv, stdout=sink, stderr=subprocess.STDOUT, check=False).returncode


def _matrix_args(options: SweepOptions) -> list[str]:
    args = ["--fixtures", str(options.fixtures), "--refs", str(options.refs), "--no-progress"]
    if options.seeds:
        args += ["--seeds", options.seeds]
    if options.steps is not None:
        args += ["--steps", str(options.steps)]
    if options.cfg is not None:
        args += ["--cfg", str(options.cfg)]
    if options.request_timeout_s is not None:
        args += ["--timeout", str(options.request_timeout_s)]
    return args


def _doctor_summary(doctor_json: Path, reports: Path) -> dict[str, Any]:
    paths = _read_json(doctor_json).get("paths") or []
    failing = [str(p.get("path")) for p in paths if isinstance(p, dict) and p.get("verdict") == "FAIL"]
    return {"passed": not failing, "failing": failing, "checked": len(paths), "report": str(reports)}


def _shown(argv: list[str]) -> str:
    """The command as a person would type it (``ditq ...`` rather than ``python -m ditq.cli ...``)."""
    if argv[:3] == [sys.executable, "-m", "ditq.cli"]:
        argv = ["ditq", *argv[3:]]
    return shlex.join(argv)


class _Sweep:
    def __init__(self, options: SweepOptions, command: str) -> None:
        self.options, self.command = options, command
        self.out = options.out
        self.baseline = self.out / "baseline"
        # the baseline is BF16 unless the servers compute in another dtype (float32 on a CPU, say)
        self.baseline_name = "BF16" if options.dtype in (None, "bfloat16") else options.dtype
        self.progress = _Progress(1 + len(SCHEME_STAGES) * len(options.schemes) + 1, options.progress)

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
    ) -> bool:
        if c.complete(stage, outputs, _shown(argv)):
            self._show(c, stage, "skipped", "complete from an earlier run")
            return True
        if argv[3:4] and argv[3] not in COMMANDS:
            c.record(stage, "skipped", 0.0, None, f"`ditq {argv[3]}` is not part of this build")
            self._show(c, stage, "skipped", f"`ditq {argv[3]}` is not part of this build")
            return True
        self._show(c, stage, "running")
        log = c.logs / f"{stage}.log"
        started = time.monotonic()
        code = _run_logged(argv, log)
        ok = code in ok_codes and all(p.exists() for p in outputs)
        message = None if ok else f"exit code {code}: {_last_line(log)}"
        c.record(stage, "ok" if ok else "failed", time.monotonic() - started, _shown(argv), message)
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
        server = _Server(self.options, self.options.model, logs / "serve-baseline.log")
        try:
            problem = server.wait_healthy(self.options.health_timeout_s)
            if problem:
                raise DitqError(f"baseline: {problem} (log: {server.log})")
            argv = ditq_argv("baseline", self.options.model, "--endpoint", server.url, "--out", self.baseline)
            argv += _matrix_args(self.options)
            atomic_write_json(logs / "baseline-commands.json", [_shown(server.argv), _shown(argv)])
            code = _run_logged(argv, logs / "baseline.log")
        finally:
            server.stop()
        if code not in (0, 1) or not seal.is_file():
            raise DitqError(
                f"baseline: exit code {code}, no sealed baseline ({_last_line(logs / 'baseline.log')})"
            )
        self.progress(self.baseline_name, "baseline", "ok", f"{time.monotonic() - started:.1f} s")
        return True

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
        quantize = ditq_argv("quantize", options.model, c.artifact, "--scheme", scheme, "--force")
        chain_ok = self._step(c, "quantize", quantize, [manifest])
        chain_ok = chain_ok and self._step(
            c, "verify", ditq_argv("verify", c.artifact, "--source", options.model), []
        )
        if chain_ok:
            # A failing kernel path is a finding, not the end of the chain: the server falls back to a path
            # that passed, the numbers show what that gives, and the verdict carries the doctor's finding.
            doctor_json, reports = c.dir / "doctor.json", c.dir / "doctor-reports"
            doctor = ditq_argv(
                "doctor", "--artifact", c.artifact, "--scheme", scheme, "--device", options.device
            )
            doctor += ["--json", str(doctor_json)]
            chain_ok = self._step(c, "doctor", [*doctor, "--report", str(reports)], [doctor_json], (0, 1))
            if chain_ok and c.stages["doctor"]["status"] == "ok":
                c.doctor = _doctor_summary(doctor_json, reports)
                c.save()
        chain_ok = chain_ok and self._serve_and_probe(c)
        baseline = self.baseline
        gate_json, compare_json = c.run_dir / "gate.json", c.run_dir / "compare.json"
        chain_ok = chain_ok and self._step(
            c, "gate", ditq_argv("gate", c.run_dir, "--baseline", baseline), [gate_json], (0, 1)
        )
        compare = ditq_argv("compare", c.run_dir, "--baseline", baseline, "--no-lpips")
        if options.parity_db is not None:
            compare += ["--parity-db", str(options.parity_db)]
        elif options.parity_pair is not None:
            compare += ["--parity-pair", *(str(p) for p in options.parity_pair)]
        if chain_ok:
            self._step(c, "compare", compare, [compare_json], (0, 1))
        for stage in SCHEME_STAGES:
            if stage not in c.reached:  # after a failure: say so, and drop what an earlier run left
                c.stages.pop(stage, None)
                self._show(c, stage, "not reached", "an earlier stage failed")
        c.save()

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
        endpoint = self.options.endpoint_for.get(c.scheme)
        server = None
        if endpoint is None:
            self._show(c, "serve", "running")
            started = time.monotonic()
            server = _Server(self.options, c.artifact, c.logs / "serve.log")
            problem = server.wait_healthy(self.options.health_timeout_s)
            c.record(
                "serve",
                "failed" if problem else "ok",
                time.monotonic() - started,
                _shown(server.argv),
                problem,
            )
            self._show(c, "serve", "FAILED" if problem else "ok", problem or server.url)
            if problem:
                server.stop()
                return False
            endpoint = server.url
        else:
            c.record("serve", "skipped", 0.0, None, f"probed through {endpoint}")
            self._show(c, "serve", "skipped", f"probed through {endpoint}")
        try:
            probe = ditq_argv(
                "probe", "--endpoint", endpoint, "--out", c.run_dir, *_matrix_args(self.options)
            )
            if server is not None:
                probe += ["--server-pid", str(server.process.pid)]
            return self._step(c, "probe", probe, [records], (0, 1))
        finally:
            if server is not None:
                server.stop()

    def report(self) -> ReportResult:
        self.progress("all", "report", "running")
        result = build_report(
            [self.out / scheme for scheme in self.options.schemes],
            self.baseline,
            self.out / "report",
            VerdictRules(parity_reference_db=self.options.parity_db),
            command=self.command,
            baseline_commands=_read_json_list(self.out / "logs" / "baseline-commands.json"),
            baseline_name=self.baseline_name,
            baseline_memory_budget=self.options.max_memory,
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
    earlier = (
        _read_json(out / "SWEEP.json").get("model_fingerprint") if (out / "SWEEP.json").is_file() else None
    )
    if not isinstance(earlier, dict) or earlier == fingerprint:
        return  # a new sweep, or one whose model is unchanged
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
    atomic_write_json(
        options.out / "SWEEP.json",
        {
            "command": command,
            "model": str(options.model),
            "model_fingerprint": fingerprint,
            "schemes": list(options.schemes),
            "fixtures": str(options.fixtures),
            "refs": str(options.refs),
            "seeds": options.seeds,
            "steps": options.steps,
            "max_memory": options.max_memory,
            "device": options.device,
            "dtype": options.dtype,
            "endpoint_for": options.endpoint_for,
            "parity_db": options.parity_db,
            "parity_pair": [str(p) for p in options.parity_pair] if options.parity_pair else None,
            "pid": os.getpid(),
        },
    )
    sweep = _Sweep(options, command)
    baseline_ran = sweep.run_baseline()
    for scheme in options.schemes:
        sweep.run_scheme(scheme, baseline_ran)
    return sweep.report()
