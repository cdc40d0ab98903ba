"""The sweep's core: its progress display, each stage as a command (skipped when complete), the baseline and
the reference pair, judging a candidate, the report."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple, TextIO

from ditq.devices import default_dtype
from ditq.errors import DitqError
from ditq.report import ReportResult, VerdictRules, build_report
from ditq.report.provenance import shell_command
from ditq.runfiles import (
    ATTEMPTS_FILE,
    BASELINE_COMMANDS_FILE,
    CommandList,
    read_model,
    write_model,
)
from ditq.sweep.candidate import Candidate, matrix_args, probe_news, run_logged, run_logged_beside
from ditq.sweep.health import Server, last_line, latest_news
from ditq.sweep.options import SCHEME_STAGES, SweepOptions, ditq_argv


class Progress:
    """One display for the whole sweep: a line per stage, counted against a total fixed at the start.

    ``stages`` are the (who, stage) pairs a sweep runs once each: the baseline, the reference pair, every
    candidate's stages, the report. Each counts the first time it finishes (ok, failed, skipped, not reached); lines
    beyond them (a server's start, another rung of the offload ladder, seeds added by --seeds auto, a running
    stage's progress every 10 s) are shown against the same count and never move the total."""

    def __init__(
        self, stages: Sequence[tuple[str, str]], enabled: bool, stream: TextIO | None = None
    ) -> None:
        self.stages, self.counted = set(stages), set[tuple[str, str]]()
        self.total, self.enabled, self.stream = len(self.stages), enabled, stream
        self.started = time.monotonic()

    def __call__(self, who: str, stage: str, status: str, detail: str = "") -> None:
        if status != "running" and (who, stage) in self.stages:
            self.counted.add((who, stage))
        if self.enabled:
            clock = time.monotonic() - self.started
            line = f"[{len(self.counted):>2}/{self.total}] {clock:6.0f}s  {who:<9} {stage:<9} {status}"
            print(line + (f": {detail}" if detail else ""), file=self.stream or sys.stderr, flush=True)

    def ticker(self, who: str, stage: str, news: Callable[[], str | None]) -> Callable[[], None]:
        """A tick for a stage that runs long: a 'running' line with what ``news`` says (when it says something)."""

        def tick() -> None:
            said = news()
            self(who, stage, "running", said or "")

        return tick


class Step(NamedTuple):
    """One stage as a command: what it runs, the files it must leave, the exit codes that pass, and why its outputs
    are not whole (None: they are)."""

    stage: str
    argv: list[str]
    outputs: Sequence[Path]
    ok_codes: tuple[int, ...] = (0,)
    unfinished: Callable[[], str | None] = lambda: None


def _news(log: Path) -> Callable[[], str | None]:
    """What a stage writing ``log`` last said (its progress line's detail)."""
    return lambda: latest_news(log)


class SweepCore:
    def __init__(self, options: SweepOptions, command: str) -> None:
        self.options, self.command = options, command
        self.out = options.out
        self.baseline = self.out / "baseline"
        self.parity_run = self.out / "parity-in-process"
        # the baseline is BF16 unless the servers compute in another dtype (float32 on a CPU, say)
        dtype = options.load.dtype or default_dtype(options.load.device)
        self.baseline_name = "BF16" if dtype == "bfloat16" else dtype
        stages = [
            (self.baseline_name, "baseline"),
            *([("bfloat16", "pair")] if options.parity_in_process else []),
        ]
        stages += [(c, stage) for c in options.candidates for stage in SCHEME_STAGES]
        self.progress = Progress([*stages, ("all", "report")], options.progress)

    def _show(self, c: Candidate, stage: str, status: str, detail: str = "") -> None:
        if status != "running":
            c.reached.add(stage)
        self.progress(c.scheme, stage, status, detail)

    # -- one stage: skip when complete, else run its command and record what happened ----------------
    def _step(
        self,
        c: Candidate,
        stage: str,
        argv: list[str],
        outputs: Sequence[Path],
        ok_codes: tuple[int, ...] = (0,),
        unfinished: Callable[[], str | None] = lambda: None,  # why the outputs are not whole (None: they are)
    ) -> bool:
        (ok,) = self._steps_beside(c, [Step(stage, argv, outputs, ok_codes, unfinished)])
        return ok

    def _steps_beside(self, c: Candidate, steps: Sequence[Step]) -> list[bool]:
        """Each stage of ``steps`` that an earlier run did not complete, all at once (each its own command), and
        whether each passed, in order: stages that wait on different parts of the machine (verify on the host's
        memory and cores, the doctor on the device) overlap instead of adding up."""
        passed: dict[str, bool] = {}
        todo = []
        for step in steps:
            if c.complete(step.stage, step.outputs, shell_command(step.argv)):
                self._show(c, step.stage, "skipped", "complete from an earlier run")
                passed[step.stage] = True
            else:
                self._show(c, step.stage, "running")
                todo.append(step)
        logs = [c.logs / f"{step.stage}.log" for step in todo]
        ticks = [
            self.progress.ticker(c.scheme, s.stage, _news(log)) for s, log in zip(todo, logs, strict=True)
        ]
        ended = run_logged_beside(
            [(s.argv, log, tick) for s, log, tick in zip(todo, logs, ticks, strict=True)]
        )
        for step, log, (code, seconds) in zip(todo, logs, ended, strict=True):
            ok = code in step.ok_codes and all(p.exists() for p in step.outputs)
            message = None if ok else f"exit code {code}: {last_line(log)}"
            if ok and (problem := step.unfinished()) is not None:
                ok, message = False, f"exit code {code}, {problem}: {last_line(log)}"
            c.record(step.stage, "ok" if ok else "failed", seconds, shell_command(step.argv), message)
            self._show(c, step.stage, "ok" if ok else "FAILED", message or f"{seconds:.1f} s")
            passed[step.stage] = ok
        return [passed[step.stage] for step in steps]

    # -- the BF16 baseline: required; without it nothing can be judged -------------------------------
    def _baseline_argv(
        self, seeds: str | None = None, only: Sequence[str] = ()
    ) -> Callable[[Server, bool], list[str]]:
        """``ditq baseline`` through a server; ``seeds`` and ``only`` where --seeds auto adds seeds."""

        def argv(server: Server, retry: bool) -> list[str]:
            out = ditq_argv("baseline", self.options.model, "--endpoint", server.url, "--out", self.baseline)
            out += [*matrix_args(self.options, seeds), *(["--only", ",".join(only)] if only else [])]
            out += ["--server-pid", str(server.process.pid)]
            return out + (["--retry-out-of-memory"] if retry else [])

        return argv

    def _add_baseline_commands(self, commands: list[str]) -> None:
        """After the ones ``logs/baseline-commands.json`` holds: the report lists them behind the baseline."""
        path = self.out / "logs" / BASELINE_COMMANDS_FILE
        earlier = read_model(CommandList, path).root if path.is_file() else []
        write_model(path, CommandList([*earlier, *commands]))

    # -- the reference pair's second run: the model in process in bfloat16 ----------------------------------
    def run_parity_pair(self) -> None:
        from ditq.judge.baseline import verify_seal

        if (self.parity_run / "SEAL.json").is_file() and not verify_seal(self.parity_run):
            self.progress("bfloat16", "pair", "skipped", "sealed by an earlier run")
            return
        self._pair_run()

    def _pair_run(self, seeds: str | None = None, only: Sequence[str] = ()) -> None:
        self.progress("bfloat16", "pair", "running")
        started = time.monotonic()
        argv = ditq_argv(
            "baseline", self.options.model, "--out", self.parity_run, *matrix_args(self.options, seeds)
        )
        argv += ["--only", ",".join(only)] if only else []
        log = self.out / "logs" / "parity-in-process.log"
        argv += ["--device", self.options.load.device]
        argv += ["--variant", self.options.load.variant] if self.options.load.variant else []
        code = run_logged(
            argv, log, self.progress.ticker("bfloat16", "pair", lambda: probe_news(self.parity_run))
        )
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

    def _gate_and_compare(self, c: Candidate) -> None:
        gate_json, compare_json = c.run_dir / "gate.json", c.run_dir / "compare.json"
        gate = ditq_argv("gate", c.run_dir, "--baseline", self.baseline)
        if self._step(c, "gate", gate, [gate_json], (0, 1)):
            compare = ditq_argv(
                "compare", c.run_dir, "--baseline", self.baseline, "--no-lpips", *self.parity_args
            )
            self._step(c, "compare", compare, [compare_json], (0, 1))

    def report(self) -> ReportResult:
        self.progress("all", "report", "running")
        attempts = self.out / "logs" / ATTEMPTS_FILE
        commands = self.out / "logs" / BASELINE_COMMANDS_FILE
        result = build_report(
            [self.out / scheme for scheme in self.options.candidates],
            self.baseline,
            self.out / "report",
            VerdictRules(
                parity_reference_db=self.options.parity_db,
                objective=self.options.objective,
                standard=self.options.standard,
            ),
            command=self.command,
            baseline_commands=read_model(CommandList, commands).root if commands.is_file() else [],
            baseline_name=self.baseline_name,
            baseline_memory_budget=self.options.load.max_memory,
            baseline_attempts=attempts if attempts.is_file() else None,
            note=self.options.note,
        )
        self.progress("all", "report", "ok", str(result.html))
        return result
