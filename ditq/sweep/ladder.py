"""Serving a candidate (the baseline too) through the offload ladder, and probing each server."""

from __future__ import annotations

import functools
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ditq.errors import DitqError
from ditq.fsutil import RUN, check_output
from ditq.report.provenance import shell_command
from ditq.runfiles import (
    ATTEMPTS_FILE,
    BASELINE_COMMANDS_FILE,
    Attempt,
    CommandList,
    write_model,
)
from ditq.sweep.candidate import (
    Candidate,
    matrix_args,
    out_of_memory_keys,
    probe_news,
    run_logged,
    unfinished_run,
)
from ditq.sweep.core import SweepCore
from ditq.sweep.health import Server, last_line, latest_news
from ditq.sweep.options import candidate_options, ditq_argv

BASELINE_LOG = (
    "baseline.log"  # the baseline's probe (``ditq baseline --endpoint``); its servers': serve-baseline*.log
)


class OffloadLadder(SweepCore):
    """The ladder: each offload mode serves what ran out of memory at the one before."""

    # -- serving through the offload ladder ------------------------------------------------------------
    def _serve_ladder(
        self,
        model: Path,
        run_dir: Path,
        logs: Path,
        who: str,
        probe_argv: Callable[[Server, bool], list[str]],
        probe_log: Path,
    ) -> tuple[list[Attempt], str | None]:
        """Serve ``model`` at each offload mode in turn until nothing ran out of memory; probe each server.

        Returns every attempt (offload, status, seconds, the server's and the probe's commands, requests
        still out of memory after it) and why the ladder stopped short (None: it did not), naming the log that
        says more: the server's when it did not start, else the probe's.
        """
        attempts: list[Attempt] = []
        serving = candidate_options(self.options, who)  # how this candidate's servers open the model
        for rung, offload in enumerate(self.options.offload):
            started = time.monotonic()
            suffix = "" if len(self.options.offload) == 1 else f"-{offload}"
            log = logs / (f"serve-baseline{suffix}.log" if who == "baseline" else f"serve{suffix}.log")
            server = Server(serving, model, log, offload)
            attempt: dict[str, Any] = {"offload": offload, "command": shell_command(server.argv)}
            # while it loads and calibrates: what its log last said
            news = self.progress.ticker(who, "serve", functools.partial(latest_news, log))
            problem = server.wait_healthy(self.options.health_timeout_s, news)
            if problem is not None:
                attempt.update(seconds=round(time.monotonic() - started, 2), message=problem)
                if server.out_of_memory_at_load:
                    attempts.append(Attempt(**attempt, status="out_of_memory_at_load"))
                    self.progress(who, "serve", "out of memory", f"offload {offload}: the model did not load")
                    continue
                attempts.append(Attempt(**attempt, status="failed"))
                return attempts, f"{problem} (log: {log})"
            ready_s = round(time.monotonic() - started, 2)
            self.progress(who, "serve", "ok", f"offload {offload}, {server.url}")
            try:
                argv = probe_argv(server, rung > 0)
                stage = "baseline" if who == "baseline" else "probe"
                ticker = self.progress.ticker(who, stage, lambda: probe_news(run_dir))  # requests done, ETA
                code = run_logged(argv, probe_log, ticker)
            finally:
                server.stop()
            remaining = out_of_memory_keys(run_dir)
            unfinished = unfinished_run(run_dir) if code in (0, 1) else None
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
                return attempts, f"exit code {code}: {last_line(probe_log)} (log: {probe_log})"
            if unfinished is not None:
                return attempts, f"exit code {code}, {unfinished}: {last_line(probe_log)} (log: {probe_log})"
            if not remaining:
                break
            self.progress(who, "probe", "out of memory", f"{len(remaining)} requests at offload {offload}")
        return attempts, None

    def _serve_and_probe(self, c: Candidate) -> bool:
        records = c.run_dir / "records.jsonl"
        if c.complete("probe", [records]):
            self._show(c, "serve", "skipped", "the probe is complete")
            self._show(c, "probe", "skipped", "complete from an earlier run")
            return True
        if c.dirty and c.run_dir.exists():
            # an earlier stage ran again (a new artifact): the old images are not this artifact's, so start
            # over; otherwise an unfinished probe (a killed sweep) resumes where it stopped
            check_output(c.run_dir, RUN)  # removed whole: only a run ditq wrote
            shutil.rmtree(c.run_dir)
            c.seeds_added, c.seed_commands = {}, []
        endpoint = self.options.endpoint_for.get(c.scheme)
        if endpoint is not None:
            c.record("serve", "skipped", 0.0, None, f"probed through {endpoint}")
            self._show(c, "serve", "skipped", f"probed through {endpoint}")
            probe = ditq_argv("probe", "--endpoint", endpoint, "--out", c.run_dir, *matrix_args(self.options))
            return self._step(c, "probe", probe, [records], (0, 1), lambda: unfinished_run(c.run_dir))

        def probe_argv(server: Server, retry: bool) -> list[str]:
            argv = ditq_argv(
                "probe", "--endpoint", server.url, "--out", c.run_dir, *matrix_args(self.options)
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

    def run_baseline(self) -> bool:
        from ditq.judge.baseline import verify_seal

        seal = self.baseline / "SEAL.json"
        if seal.is_file() and not verify_seal(self.baseline):
            self.progress(self.baseline_name, "baseline", "skipped", "sealed by an earlier run")
            return False
        self.progress(self.baseline_name, "baseline", "running")
        started = time.monotonic()
        logs = self.out / "logs"

        attempts, failure = self._serve_ladder(
            self.options.model, self.baseline, logs, "baseline", self._baseline_argv(), logs / BASELINE_LOG
        )
        write_model(logs / ATTEMPTS_FILE, attempts)
        commands = [c for a in attempts for c in (a.command, a.probe_command) if c]
        write_model(logs / BASELINE_COMMANDS_FILE, CommandList(commands))
        if failure is not None or not seal.is_file():
            raise DitqError(f"baseline: {failure or f'no sealed baseline (log: {logs / BASELINE_LOG})'}")
        self.progress(self.baseline_name, "baseline", "ok", f"{time.monotonic() - started:.1f} s")
        return True
