"""Running (or resuming) a whole sweep: the baseline, every candidate's chain, seed settling, the report."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from ditq.devices import default_dtype
from ditq.errors import InputError
from ditq.fsutil import SWEEP, atomic_write_bytes, check_output
from ditq.probe.fixtures import seeds_text
from ditq.probe.runner import PROBE_API_KEY_ENV
from ditq.quantization.plan_file import PLAN_FILE, plan_bytes
from ditq.report import ReportResult
from ditq.report.provenance import shell_command
from ditq.runfiles import (
    SWEEP_FILE,
    StageEntry,
    SweepFile,
    read_model,
    write_model,
)
from ditq.sweep import launch
from ditq.sweep.candidate import Candidate, doctor_summary
from ditq.sweep.core import Step
from ditq.sweep.options import (
    GPTQ,
    SCHEME_STAGES,
    SweepOptions,
    candidate_group_size,
    candidate_scheme,
    ditq_argv,
    seeds_warning,
)
from ditq.sweep.seeds import SeedSettling


class Sweep(SeedSettling):
    """One sweep: every stage of every candidate."""

    # -- one scheme ----------------------------------------------------------------------------------
    def run_scheme(self, scheme: str, baseline_ran: bool) -> None:
        c = Candidate(self.options, scheme)
        if baseline_ran:  # gate and compare read the baseline: a new baseline means new judgments
            for stage in ("gate", "compare"):
                c.stages.pop(stage, None)
        c.save()
        if c.earlier is not None:
            chain_ok = self._earlier_artifact(c) and self._doctor(c)
        elif c.shares is not None:
            chain_ok = self._shared_artifact(c) and self._doctor(c)
        else:
            chain_ok = self._quantize_verify_and_doctor(c)
        chain_ok = chain_ok and self._serve_and_probe(c)
        if chain_ok:
            self._gate_and_compare(c)
        for stage in SCHEME_STAGES:
            if stage not in c.reached:  # after a failure: say so, and drop what an earlier run left
                c.stages.pop(stage, None)
                self._show(c, stage, "not reached", "an earlier stage failed")
        c.save()

    def _doctor_step(self, c: Candidate) -> Step:
        """The doctor on the candidate's artifact: its kernel paths (a plan's: every scheme it holds) on the
        servers' device, in their dtype. Exit code 1 (a path failed) passes the stage: a failing kernel path is a finding, not the end
        of the chain; the server falls back to a path that passed, the numbers show what that gives, and the verdict
        carries the doctor's finding."""
        only = [] if c.plan is not None else ["--scheme", candidate_scheme(c.scheme)]
        argv = ditq_argv("doctor", "--artifact", c.artifact, *only, "--device", self.options.load.device)
        # at the dtype its servers compute in (each path that takes it): what the candidate is served with
        argv += ["--dtype", self.options.load.dtype or default_dtype(self.options.load.device)]
        argv += ["--json", str(c.dir / "doctor.json"), "--report", str(c.dir / "doctor-reports")]
        return Step("doctor", argv, [c.dir / "doctor.json"], (0, 1))

    def _doctor(self, c: Candidate) -> bool:
        """The doctor's stage alone (the artifact verified by an earlier run or another candidate)."""
        (passed,) = self._steps_beside(c, [self._doctor_step(c)])
        return self._doctor_found(c, passed)

    def _doctor_found(self, c: Candidate, passed: bool) -> bool:
        """``passed``, with the doctor's summary kept on the candidate where its stage ran whole."""
        if passed and c.stages["doctor"].status == "ok":
            c.doctor = doctor_summary(c.dir / "doctor.json", c.dir / "doctor-reports")
            c.save()
        return passed

    def _quantize_verify_and_doctor(self, c: Candidate) -> bool:
        """The candidate's own artifact: quantized (with its scheme, or its plan), then verified against the source
        beside the doctor (the host's work beside the device's)."""
        options = self.options
        manifest = c.artifact / "MANIFEST.json"
        if c.plan is not None:
            # a copy beside the candidate: what quantize reads and the report shows are the same file
            c.dir.mkdir(parents=True, exist_ok=True)
            copy, fresh = c.dir / PLAN_FILE, plan_bytes(c.plan)
            if copy.is_file() and copy.read_bytes() != fresh:
                c.dirty = True  # another plan than the one an earlier run quantized: every stage runs again
            atomic_write_bytes(copy, fresh)
        if not self._step(c, "quantize", quantize_argv(options, c), [manifest]):
            return False
        verify = Step("verify", ditq_argv("verify", c.artifact, "--source", options.model), [])
        verified, doctored = self._steps_beside(c, [verify, self._doctor_step(c)])
        return self._doctor_found(c, doctored) and verified

    def _shared_artifact(self, c: Candidate) -> bool:
        """A candidate that serves another's artifact (``fp8-fast`` serving ``fp8``'s): its quantize and verify are
        that candidate's, which ran first in this sweep; whole only where both passed there."""
        stages = Candidate(self.options, str(c.shares)).stages
        return self._borrowed_stages(c, stages, f"{c.shares}'s artifact", "by its candidate")

    def _earlier_artifact(self, c: Candidate) -> bool:
        """A candidate that serves the artifact an earlier sweep quantized and verified (``artifacts_from``: the
        sweep without a step cache, for ``--cache auto``'s settings); whole only where both passed there."""
        assert c.earlier is not None
        # the candidate that quantized it there (fp8's for fp8-fast)
        earlier = dataclasses.replace(self.options, out=c.earlier, artifacts_from=None)
        stages = Candidate(earlier, c.shares or c.scheme).stages
        return self._borrowed_stages(c, stages, f"the artifact of {c.earlier}", "there")

    def _borrowed_stages(
        self, c: Candidate, stages: dict[str, StageEntry], artifact: str, where: str
    ) -> bool:
        """Record ``stages``' quantize and verify (another candidate's, of ``artifact``) as ``c``'s, skipped; False,
        recording the failure, where either did not pass there."""
        for stage in ("quantize", "verify"):
            entry = stages.get(stage)
            if entry is None or entry.status != "ok":
                message = f"{artifact} is not whole: its {stage} did not pass"
                c.record(stage, "failed", 0.0, None, message)
                self._show(c, stage, "FAILED", message)
                return False
            c.record(stage, "skipped", 0.0, entry.command, f"{artifact}, {stage} {where}")
            self._show(c, stage, "skipped", artifact)
        return True


def quantize_argv(options: SweepOptions, c: Candidate) -> list[str]:
    """The ``ditq quantize`` that makes candidate ``c``'s artifact: with its plan (the copy beside it), or with its
    scheme (``candidate_scheme``), ``--group-size channel`` for a ``-channel`` candidate and ``--calibrate gptq`` on
    the sweep's fixtures for a ``-gptq`` one (or a plan rounded by GPTQ), its source placed as the servers' last
    offload rung places it, under their ``--max-memory``."""
    # --force: an artifact left by an interrupted or older run is replaced (quantize writes atomically)
    if c.plan is not None:
        argv = ditq_argv("quantize", options.model, c.artifact, "--plan", c.dir / PLAN_FILE, "--force")
    else:
        # a -fast candidate quantizes as its scheme does; only its servers accumulate differently
        argv = ditq_argv(
            "quantize", options.model, c.artifact, "--scheme", candidate_scheme(c.scheme), "--force"
        )
        group_size = candidate_group_size(c.scheme)
        argv += ["--group-size", str(group_size)] if group_size is not None else []
    # calibrated on the sweep's own fixtures, at seeds the probes do not use (a plan: the seeds it records)
    if c.scheme.endswith(GPTQ) or (c.plan is not None and c.plan.rounding.method == "gptq"):
        argv += ["--calibrate", "gptq", "--fixtures", str(options.fixtures), "--refs", str(options.refs)]
        argv += options.calibration.flags()
        # the requests run the source model within what its servers are given: the ladder's last rung, the cap
        argv += ["--offload", options.offload[-1]]
        argv += ["--max-memory", options.load.max_memory] if options.load.max_memory else []
    argv += ["--device", options.load.device]  # the device the servers use encodes fastest
    return argv + (["--variant", options.load.variant] if options.load.variant else [])


def model_fingerprint(model: Path) -> dict[str, list[int]]:
    """Every file of the model directory -> [size, mtime_ns]: what a sweep's finished stages were made from."""
    stats = {str(path.relative_to(model)): path.stat() for path in sorted(model.rglob("*")) if path.is_file()}
    return {name: [stat.st_size, stat.st_mtime_ns] for name, stat in stats.items()}


def lora_fingerprint(options: SweepOptions) -> dict[str, list[int]]:
    """--lora's weight file -> [size, mtime_ns], under ``--lora PATH``: the baseline and every probe were drawn with
    it, so another adapter (or the same one changed) makes them stale like other model files do."""
    if options.lora is None:
        return {}
    stat = options.lora.weight_file().stat()
    return {
        f"--lora {options.lora.weight_file()} (scale {options.lora.scale:g})": [
            stat.st_size,
            stat.st_mtime_ns,
        ]
    }


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


SERVER_API_KEY_ENV = "DITQ_API_KEY"  # what ditq serve reads its --api-key from


@contextlib.contextmanager
def _sweep_keys(api_key: str | None) -> Iterator[None]:
    """For the sweep's length, the servers it starts require exactly ``api_key`` and the probes and baselines it
    runs send exactly it (none: none), whatever the shell exported: both read their key from the environment they
    inherit (a server requiring a key its probes did not send answered every request with 401)."""
    names = (SERVER_API_KEY_ENV, PROBE_API_KEY_ENV)
    before = {name: os.environ.pop(name, None) for name in names}
    if api_key:
        os.environ.update(dict.fromkeys(names, api_key))
    try:
        yield
    finally:
        for name, value in before.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value


def check_sweep_output(options: SweepOptions) -> None:
    """The sweep's folder is written into (``ditq.fsutil.check_output``): new, empty or an earlier sweep's, and
    apart from its inputs (model, fixtures, references, plan, adapter); else an InputError naming it."""
    inputs = [options.model, options.fixtures, options.refs, *([options.plan] if options.plan else [])]
    inputs += [options.lora.path] if options.lora is not None else []
    check_output(options.out, SWEEP, inputs, replace=False)


def run_sweep(options: SweepOptions, command: str | None = None, shared: Path | None = None) -> ReportResult:
    """Run (or resume) the whole sweep and return its report. ``--cache auto`` searches a step cache setting, a
    sweep per setting (``ditq.sweep.step_cache``); ``shared`` is the folder of an earlier sweep of the same model
    whose sealed baseline (and reference pair) this one reads instead of running its own."""
    from ditq.runtime.step_cache import AUTO
    from ditq.sweep.step_cache import link_shared_runs, search_step_cache

    if options.load.cache == AUTO:
        check_sweep_output(options)
        return search_step_cache(options, command or shell_command(), run_sweep)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per /health poll is noise
    if (warning := seeds_warning(options.seeds)) is not None:  # said first: nothing it runs can decide
        logging.getLogger(__name__).warning("%s", warning)
    check_sweep_output(options)
    fingerprint = model_fingerprint(options.model) | lora_fingerprint(options)
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
        offload=list(options.offload),
        note=options.note,
        endpoint_for=options.endpoint_for,
        parity_db=options.parity_db,
        parity_pair=[str(p) for p in options.parity_pair] if options.parity_pair else None,
        parity_in_process=options.parity_in_process,
        max_seeds=options.max_seeds if options.seeds == "auto" else None,
        plan=None if options.plan is None else str(options.plan),
        lora=None if options.lora is None else f"{options.lora.path}:{options.lora.scale:g}",
        # the servers' options, as SWEEP.json has always named them
        **options.load.record(
            "max_memory",
            "variant",
            "device",
            "dtype",
            "attention",
            "kv_cache",
            "cache",
            "accumulate",
            "compile",
        ),
        pid=os.getpid(),
    )
    write_model(options.out / SWEEP_FILE, sweep_file)
    if shared is not None:
        link_shared_runs(shared, options.out)
    sweep = Sweep(options, command)
    with (
        launch.forking(options.load.device == "cpu"),  # a CPU sweep's commands are forked (ditq.sweep.launch)
        _sweep_keys(options.api_key),
    ):
        baseline_ran = sweep.run_baseline()
        if options.parity_in_process:
            sweep.run_parity_pair()
        for scheme in options.candidates:
            sweep.run_scheme(scheme, baseline_ran)
        if options.seeds == "auto":
            seeds = sweep.settle_seeds()
            by_fixture = {fixture_id: seeds_text(s) for fixture_id, s in seeds.items()}
            write_model(
                options.out / SWEEP_FILE, sweep_file.model_copy(update={"seeds_by_fixture": by_fixture})
            )
        return sweep.report()
