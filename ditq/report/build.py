"""`ditq report`: gather runs, judge them, write REPORT.md, report.html, verdict.json, charts and grids."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ditq.errors import InputError
from ditq.fsutil import REPORT, atomic_directory, check_output
from ditq.judge.compare import (
    LOSSLESS_PSNR_DB,
    LOSSLESS_SSIM,
    LosslessStandard,
    ParityBand,
    compare_run,
    parity_from_pair,
)
from ditq.judge.gate import Envelope, build_envelopes, gate_run, load_rules
from ditq.report.assess import ReportData, assess
from ditq.report.charts import write_charts
from ditq.report.grids import write_grids, write_lead_grid
from ditq.report.html import render_html
from ditq.report.markdown import render_markdown
from ditq.report.model import RunData, load_candidate
from ditq.report.plan import write_plan_charts
from ditq.report.provenance import shell_command
from ditq.report.schema import validate_verdict
from ditq.report.verdict import VerdictRules
from ditq.runfiles import (
    COMPARE_FILE,
    GATE_FILE,
    Attempt,
    CompareFile,
    CompareRow,
    GateFile,
    ParityResult,
    read_model,
    read_model_list,
)
from ditq.signatures import DEFAULT_RULES_SOURCE, GateRules

log = logging.getLogger(__name__)

__all__ = ["ReportResult", "build_report"]


@dataclass(frozen=True)
class ReportResult:
    out_dir: Path
    markdown: Path
    html: Path
    verdict_json: Path
    data: ReportData

    @property
    def verdicts(self) -> dict[str, str]:
        return {c.name: c.verdict for c in self.data.document.candidates}

    def __repr__(self) -> str:
        """One line (``data`` holds every run): where the report is, and each candidate's verdict."""
        return f"ReportResult(html={str(self.html)!r}, verdicts={self.verdicts!r})"


def check_gate_file(
    run_dir: Path, baseline: Path, judges: dict[str, tuple[GateRules, dict[str, Envelope]]]
) -> None:
    """The run's ``gate.json`` says what its records and images say: the run is judged again against
    ``baseline`` with the rules the file names, and any image whose pass or fail differs is an InputError naming
    the file (an edited or stale gate.json). Rules that can no longer be read are a warning: not judged again.
    ``judges`` keeps each rules file's rules and the baseline's envelopes under them, shared by the runs."""
    path = run_dir / GATE_FILE
    stated = read_model(GateFile, path)
    if stated.rules not in judges:
        if stated.rules != DEFAULT_RULES_SOURCE and not Path(stated.rules).is_file():
            log.warning("%s: its rules file %s is gone: the gate was not judged again", path, stated.rules)
            return
        rules = load_rules(None if stated.rules == DEFAULT_RULES_SOURCE else Path(stated.rules))
        judges[stated.rules] = rules, build_envelopes(baseline, rules)
    rules, envelopes = judges[stated.rules]
    judged = gate_run(run_dir, rules, envelopes, None, baseline)
    again = {(r.fixture_id, r.seed): r for r in judged.records}
    for record in stated.records:
        now = again.get((record.fixture_id, record.seed))
        if now is None or now.passed != record.passed:
            said = "passed" if record.passed else "failed"
            why = f" ({'; '.join(now.reasons)[:200]})" if now is not None and now.reasons else ""
            raise InputError(
                f"{path}: says {record.fixture_id} seed {record.seed} {said}, which its records and images do not "
                f"show against this baseline{why}: an edited or stale gate.json (run ditq gate again)"
            )
    if set(again) != {(r.fixture_id, r.seed) for r in stated.records}:
        raise InputError(f"{path}: judges other images than the run holds (stale: run ditq gate again)")


def rederive_compare(run: RunData, baseline: Path) -> None:
    """The run's ``compare.json`` says what its records and images say: compare runs again against ``baseline``
    (without LPIPS), and a row whose status, PSNR or SSIM differs is an InputError naming the file (an edited or
    stale compare.json). The run's fidelity is then the one computed here, its decisions derived again from those
    rows, never the file's: under the report's own lossless thresholds (or the file's where they are stricter) and
    the parity band the file states, derived again from its pair where that pair is still there."""
    path = run.path / COMPARE_FILE
    stated = read_model(CompareFile, path)
    thresholds = (LOSSLESS_PSNR_DB, LOSSLESS_SSIM)
    if stated.lossless is not None:  # a forged file cannot lower them
        thresholds = (max(stated.lossless.psnr_db, thresholds[0]), max(stated.lossless.ssim, thresholds[1]))
    again = compare_run(
        run.path,
        baseline,
        baseline_seal=stated.baseline_seal,
        parity=_band(stated.parity),
        use_lpips=False,
        lossless=LosslessStandard(*thresholds),
    )
    now = {(r.fixture_id, r.seed): r for r in again.rows}
    for row in stated.rows:
        fresh = now.get((row.fixture_id, row.seed))
        if fresh is None or _row_text(fresh) != _row_text(row):
            shown = (
                "no row" if fresh is None else _row_text(fresh) + (f" ({fresh.error})" if fresh.error else "")
            )
            raise InputError(
                f"{path}: says {row.fixture_id} seed {row.seed} is {_row_text(row)}, which its images show as "
                f"{shown} against this baseline: an edited or stale compare.json (run ditq compare again)"
            )
    if set(now) != {(r.fixture_id, r.seed) for r in stated.rows}:
        raise InputError(f"{path}: compares other images than the run holds (stale: run ditq compare again)")
    run.take_compare(again)


def _band(parity: ParityResult | None) -> ParityBand | None:
    """The parity band compare.json states: derived again from its pair where both runs are still where it says;
    a PSNR the user stated (``--parity-db``) is taken as stated."""
    if parity is None:
        return None
    if parity.source.startswith("pair ") and " vs " in parity.source:
        first, second = (Path(p) for p in parity.source.removeprefix("pair ").split(" vs ", 1))
        if first.is_dir() and second.is_dir():
            return parity_from_pair(first, second, parity.tolerance_db)
    per_seed = {fixture: dict(seeds) for fixture, seeds in (parity.per_seed_db or {}).items()}
    return ParityBand(
        parity.source, parity.overall_db, dict(parity.per_fixture_db), parity.tolerance_db, per_seed
    )


def _row_text(row: CompareRow) -> str:
    """A row's status and figures at the precision compare writes them."""
    if row.status != "ok":
        return row.status
    return f"PSNR {row.psnr_db} dB, SSIM {row.ssim}"


def build_report(
    runs: Sequence[Path],
    baseline: Path,
    out: Path,
    rules: VerdictRules | None = None,
    command: str | None = None,
    baseline_commands: Sequence[str] = (),
    baseline_name: str | None = None,
    baseline_memory_budget: str | None = None,
    baseline_attempts: Path | None = None,
    note: str | None = None,
) -> ReportResult:
    """Judge every candidate in ``runs`` against ``baseline`` and write the report directory ``out``.

    ``baseline_commands`` are the command lines behind the baseline and ``baseline_attempts`` the file of
    its offload attempts (``logs/baseline-attempts.json``), when the caller has them (a sweep does).
    ``note`` is said first, in the report and in verdict.json. ``out`` is replaced as a whole (written
    beside it, then renamed), so a report on disk is always complete.
    """
    out = Path(out)
    if not runs:
        raise InputError("report: name at least one run or candidate directory")
    inputs = [Path(baseline), *map(Path, runs)]
    check_output(out, REPORT, inputs)  # replaced whole: only an earlier report, never an input
    attempts = read_model_list(Attempt, baseline_attempts) if baseline_attempts is not None else None
    base = load_candidate(Path(baseline), attempts)
    if base.run is None:
        raise InputError(f"{baseline}: the baseline has no records")
    if baseline_name is not None:
        base.name = baseline_name
    elif base.name in ("baseline", base.run.path.name):
        base.name = "BF16"
    base.extra_commands = list(baseline_commands)
    base.memory_budget = baseline_memory_budget or base.memory_budget
    candidates = [load_candidate(Path(run)) for run in runs]
    names = [c.name for c in candidates]
    for name in names:
        if names.count(name) > 1 or name == base.name:
            raise InputError(
                f"report: two runs are both named {name!r} (rename a run directory, or a candidate's name in "
                "CANDIDATE.json)"
            )
    judges: dict[str, tuple[GateRules, dict[str, Envelope]]] = {}
    for candidate in candidates:
        run = candidate.run
        if (
            run is not None and run.gate is not None and not run.incomplete
        ):  # an incomplete run is never a yes
            check_gate_file(run.path, Path(baseline), judges)
        if run is not None and (run.path / COMPARE_FILE).is_file():
            rederive_compare(run, Path(baseline))
    data = assess(base, candidates, command or shell_command(), rules, note)
    document = data.document.model_dump(mode="json")
    validate_verdict(document)  # what we write is what the schema promises
    with atomic_directory(out, REPORT, inputs, force=True) as tmp:
        plans = {c.name: c.plan for c in candidates if c.plan is not None}
        charts = {**write_charts(data, tmp / "charts"), **write_plan_charts(plans, tmp / "charts")}
        grids = write_grids(base, candidates, tmp / "grids")
        lead = next((c for c in candidates if c.name == data.document.recommendation.candidate), None)
        lead_grid = write_lead_grid(base, lead or next((c for c in candidates if c.run), None), tmp / "grids")
        grids += [lead_grid] if lead_grid is not None else []
        # NaN or infinity is not JSON: refused here rather than written (the records' figures are finite on read)
        (tmp / "verdict.json").write_text(json.dumps(document, indent=2, allow_nan=False) + "\n")
        (tmp / "REPORT.md").write_text(render_markdown(data, charts, grids, tmp))
        (tmp / "report.html").write_text(render_html(data, charts, grids))
    return ReportResult(out, out / "REPORT.md", out / "report.html", out / "verdict.json", data)
