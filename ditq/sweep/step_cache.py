"""``ditq sweep --cache auto``: each scheme's cheapest step cache setting whose fidelity stays inside the standard.

The search is the sweep itself, run once per setting: first without a step cache (into OUT, as a sweep without
``--cache`` runs: every scheme's verdict and speed), then for each setting of ``AUTO_SETTINGS`` in order, from the
one that skips least, a sweep of the schemes still searched into ``OUT/cache/SETTING`` whose candidates' servers
run it (``--cache SETTING``; the baseline computes every step, and is the first sweep's, linked, not run again;
each candidate serves the artifact the first sweep quantized and verified, ``SweepOptions.artifacts_from``).
A scheme stops at the first setting where one of its verdict's fidelity comparisons under ``--standard`` (the
intervals over seeds of ``fit_by_standard``: PSNR and SSIM, or PSNR less the band's) is not inside, and keeps the one
before it; a scheme that does not pass without a step cache has nothing to search. The
answer, per scheme, is ``OUT/STEP_CACHE.json``: every setting tried with its decision, skipped steps per request and
seconds per image, the setting chosen and the speed it buys (seconds per image without a step cache over with it).
The plan candidate (``--plan``) is judged without a step cache only.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ditq.fsutil import atomic_write_bytes
from ditq.probe.records import latest_by_key, read_records
from ditq.report import ReportResult
from ditq.report.schema import CandidateVerdict
from ditq.runfiles import RECORDS_FILE
from ditq.sweep.options import SweepOptions

__all__ = ["AUTO_SETTINGS", "STEP_CACHE_FILE", "link_shared_runs", "search_step_cache"]

# From the setting that skips least to the one that skips most (First Block Cache's threshold: the relative change of
# the first block's residual below which the other blocks are skipped); the search stops at a scheme's first failure.
AUTO_SETTINGS = ("first-block:0.2", "first-block:0.3", "first-block:0.4", "first-block:0.6")
STEP_CACHE_FILE = "STEP_CACHE.json"
_SHARED = ("baseline", "parity-in-process")  # the first sweep's runs every later one reads, linked
# the verdict's fidelity comparisons under either standard: lossless (PSNR and SSIM), parity (PSNR less the band's)
_FIDELITY_MEASURES = ("psnr_db", "ssim", "psnr_minus_reference_db")


def search_step_cache(
    options: SweepOptions,
    command: str,
    run_sweep: Callable[..., ReportResult],
    settings: tuple[str, ...] = AUTO_SETTINGS,
) -> ReportResult:
    """Run the search (``options.load.cache`` is ``auto``; ``SweepOptions`` refused it beside ``--seeds auto`` and
    ``--endpoint-for``) through ``run_sweep`` (``ditq.sweep.run.run_sweep``, which calls this); returns the report
    of the sweep without a step cache."""
    uncached = run_sweep(_with_setting(options, None, options.schemes, options.out), command)
    by_name = {c.name: c for c in uncached.data.document.candidates}
    searched = {scheme: [_row(None, by_name[scheme], options)] for scheme in options.schemes}
    alive = [scheme for scheme in options.schemes if searched[scheme][0]["passed"]]
    for setting in settings:
        if not alive:
            break
        out = options.out / "cache" / setting.replace(":", "-")
        report = run_sweep(_with_setting(options, setting, tuple(alive), out), command, shared=options.out)
        by_name = {c.name: c for c in report.data.document.candidates}
        for scheme in alive:
            searched[scheme].append(_row(setting, by_name[scheme], options, out))
        alive = [scheme for scheme in alive if searched[scheme][-1]["passed"]]
    choices = {scheme: _choice(rows) for scheme, rows in searched.items()}
    answer = {
        "command": command,
        "standard": options.standard,
        "settings": [None, *settings],
        "schemes": choices,
    }
    atomic_write_bytes(options.out / STEP_CACHE_FILE, (json.dumps(answer, indent=1) + "\n").encode())
    if options.progress:
        for scheme, choice in choices.items():
            print(f"step cache {scheme:<9} {choice['summary']}", flush=True)
        print(f"step cache: {options.out / STEP_CACHE_FILE}", flush=True)
    return uncached


def _with_setting(
    options: SweepOptions, setting: str | None, schemes: tuple[str, ...], out: Path
) -> SweepOptions:
    """The sweep of one setting: its schemes, its folder, its servers' ``--cache`` (the plan only without one)."""
    return dataclasses.replace(
        options,
        schemes=schemes,
        out=out,
        load=options.load.replace(cache=setting),
        plan=options.plan if setting is None else None,
        artifacts_from=None if setting is None else options.out,  # quantized and verified once, there
    )


def link_shared_runs(first: Path, out: Path) -> None:
    """The first sweep's sealed baseline (and reference pair) linked into the sweep folder ``out``: a setting's
    candidates are judged against the same runs, which are not run again."""
    for name in _SHARED:
        source, link = first / name, out / name
        if source.is_dir() and not os.path.lexists(link):
            link.symlink_to(os.path.relpath(source, out), target_is_directory=True)


def _row(
    setting: str | None, verdict: CandidateVerdict, options: SweepOptions, out: Path | None = None
) -> dict[str, Any]:
    """One setting's outcome for one scheme: whether every fidelity comparison under the standard is inside (a
    collapse signature or a memory answer is the verdict's, and said beside it), skipped steps, speed."""
    fit = verdict.objectives.fit_by_standard[options.standard]
    fidelity = [entry for entry in fit.intervals if entry.measure in _FIDELITY_MEASURES]
    seconds = list(verdict.profile.seconds_per_image.values())
    run = (out or options.out) / verdict.name / "run"
    records = latest_by_key(read_records(run)) if (run / RECORDS_FILE).is_file() else {}
    per_request = {
        f"{fixture_id}.s{seed}": (record.metrics or {}).get("skipped_steps")
        for (fixture_id, seed), record in records.items()
    }
    skipped = [n for n in per_request.values() if n is not None]
    return {
        "cache": setting,
        "passed": bool(fidelity) and all(entry.decision == "inside" for entry in fidelity),
        "fidelity": {entry.subject: entry.decision for entry in fidelity},
        "fit_to_serve": fit.answer,  # the verdict's whole answer (stage failures, collapse and memory too)
        "reasons": [reason.message for reason in fit.reasons],
        "skipped_steps_per_request": per_request,
        "skipped_steps_mean": round(statistics.mean(skipped), 2) if skipped else None,
        "seconds_per_image_mean": round(statistics.mean(seconds), 4) if seconds else None,
        "report": str((out or options.out) / "report"),
    }


def _choice(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The last setting that passed (none: no step cache), and the speed it buys over no step cache."""
    passed = [row for row in rows if row["passed"]]
    chosen = passed[-1] if passed else None
    setting = None if chosen is None else chosen["cache"]
    before = rows[0]["seconds_per_image_mean"]
    after = None if chosen is None else chosen["seconds_per_image_mean"]
    speedup = round(before / after, 3) if before and after else None
    if not passed:
        summary = "no setting: fidelity does not pass without a step cache"
    elif setting is None:
        summary = f"no step cache: {rows[1]['cache']} already fails" if len(rows) > 1 else "no step cache"
    else:
        summary = (
            f"{setting}: {passed[-1]['skipped_steps_mean']} steps skipped per request, {speedup}x the speed"
        )
    return {"chosen": setting, "speedup": speedup, "summary": summary, "tried": rows}
