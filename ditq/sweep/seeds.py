"""``--seeds auto``: more seeds for the fixtures a compare left undecided, shared by every run."""

from __future__ import annotations

import time

from ditq.errors import DitqError
from ditq.judge.compare import seeds_to_add
from ditq.judge.compare import settle_seeds as settle
from ditq.probe.fixtures import DEFAULT_SEEDS, parse_seeds, seeds_text
from ditq.report.provenance import shell_command
from ditq.runfiles import (
    CompareFile,
    read_model,
)
from ditq.sweep.candidate import (
    Candidate,
    matrix_args,
    probe_news,
    run_logged,
    seeds_by_fixture,
    unfinished_run,
)
from ditq.sweep.health import Server, last_line
from ditq.sweep.ladder import BASELINE_LOG, OffloadLadder
from ditq.sweep.options import ditq_argv


class SeedSettling(OffloadLadder):
    """Settling undecided fixtures with more seeds."""

    # -- --seeds auto: more seeds for the fixtures a compare left undecided ----------------------------
    def settle_seeds(self) -> dict[str, list[int]]:
        """Round after round (``ditq.judge.compare.settle_seeds``), give every fixture that some candidate's compare
        left undecided under the sweep's standard (lossless or parity) about as many seeds as that compare said
        would settle it (at least one more, at most --max-seeds, the most any candidate asks): the baseline, the
        in-process pair and every judged candidate probe the new seeds of those fixtures only (``--only``), then
        gate and compare run again. A fixture's seeds are shared by every run, so that every PSNR stays paired.
        Returns the seeds each fixture was run at."""
        start = parse_seeds(DEFAULT_SEEDS)

        def run_more(more: dict[str, list[int]]) -> None:
            # the probe takes a seed range: fixtures grouped by the last seed they run to
            groups: dict[int, list[str]] = {}
            for fixture_id, added in more.items():
                groups.setdefault(max(added), []).append(fixture_id)
            plan = [
                (seeds_text([*start, *range(max(start) + 1, last + 1)]), ids)
                for last, ids in sorted(groups.items())
            ]
            for seeds, fixture_ids in plan:
                self.progress("all", "seeds", "ok", f"{', '.join(fixture_ids)}: seeds {seeds}")
                self._extend_baseline(seeds, fixture_ids)
                if self.options.parity_in_process:
                    self._pair_run(seeds, fixture_ids)
            for scheme in self.options.candidates:
                self._extend_candidate(Candidate(self.options, scheme), plan, len(start))

        settle(self._more_seeds, run_more)
        return seeds_by_fixture(self.baseline)

    def _judged(self) -> list[tuple[str, CompareFile]]:
        """The candidates whose compare ran, with its result."""
        out = []
        for scheme in self.options.candidates:
            c = Candidate(self.options, scheme)
            compare = c.stages.get("compare")
            path = c.run_dir / "compare.json"
            if compare is not None and compare.status == "ok" and path.is_file():
                out.append((scheme, read_model(CompareFile, path)))
        return out

    def _more_seeds(self) -> dict[str, list[int]]:
        """Fixture -> the seeds to add, for every fixture some compare left undecided (under the sweep's standard)
        below the cap: the most that any candidate's decision asks for."""
        current, cap = seeds_by_fixture(self.baseline), self.options.max_seeds
        more: dict[str, list[int]] = {}
        for _, compare in self._judged():
            for fixture_id, entry in compare.fixtures.items():
                decision = entry.lossless if self.options.standard == "lossless" else entry.parity
                wanted = seeds_to_add(decision, current.get(fixture_id, []), cap)
                if len(wanted) > len(more.get(fixture_id, [])):
                    more[fixture_id] = wanted
        return more

    def _extend_baseline(self, seeds: str, fixture_ids: list[str]) -> None:
        have = seeds_by_fixture(self.baseline)
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
            logs / BASELINE_LOG,
        )  # ``ditq baseline`` seals the run again over the added records and images
        self._add_baseline_commands([c for a in attempts for c in (a.command, a.probe_command) if c])
        if failure is not None or not (self.baseline / "SEAL.json").is_file():
            raise DitqError(f"baseline: {failure or f'no sealed baseline (log: {logs / BASELINE_LOG})'}")
        self.progress(self.baseline_name, "baseline", "ok", f"seeds {seeds} for {', '.join(fixture_ids)}")

    def _extend_candidate(self, c: Candidate, plan: list[tuple[str, list[str]]], started_with: int) -> None:
        compare = c.stages.get("compare")
        if compare is None or compare.status != "ok":
            return  # not judged: nothing to settle
        for seeds, fixture_ids in plan:
            have = seeds_by_fixture(c.run_dir)
            wanted = set(parse_seeds(seeds))
            missing = [f for f in fixture_ids if not wanted <= set(have.get(f, []))]
            if not missing:
                continue
            self._show(c, "probe", "running", f"seeds {seeds} for {', '.join(missing)}")
            begun = time.monotonic()
            matrix = [*matrix_args(self.options, seeds), "--only", ",".join(missing)]
            endpoint = self.options.endpoint_for.get(c.scheme)
            if endpoint is not None:
                argv = ditq_argv("probe", "--endpoint", endpoint, "--out", c.run_dir, *matrix)
                code = run_logged(
                    argv,
                    c.logs / "probe.log",
                    self.progress.ticker(c.scheme, "probe", lambda: probe_news(c.run_dir)),
                )
                c.seed_commands.append(shell_command(argv))
                failure = None if code in (0, 1) else f"exit code {code}: {last_line(c.logs / 'probe.log')}"
                failure = failure or unfinished_run(c.run_dir)
            else:

                def probe_argv(server: Server, retry: bool, matrix: list[str] = matrix) -> list[str]:
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
