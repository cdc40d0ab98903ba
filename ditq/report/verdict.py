"""Fit to serve: YES only when no rule below finds a reason; NO when one finds a reason against it;
UNDECIDED when the only reasons are missing evidence (no gate or compare result, a baseline that collapses
too, a fixture whose interval straddles the standard's floor).

Fidelity is judged by one of two standards (``VerdictRules.standard``): *parity*, as close to the baseline as a
second acceptable run is (compare's parity band), or *lossless*, visually lossless by stated PSNR and SSIM
thresholds (compare's lossless decisions). The report answers both and heads with the one chosen.

Every reason is one sentence a person can act on, with a code a program can match. The
rules read the capacity matrix, the gate, compare's parity band and the sweep's stage
records; their thresholds are data (:class:`VerdictRules`), not branches. Speed and size are
answered apart (``ditq.report.objectives``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

from ditq.judge.compare import (
    LOSSLESS_PSNR_DB,
    LOSSLESS_SSIM,
    describe_lossless,
    describe_parity,
    same_bytes_note,
)
from ditq.report.capacity import FidelitySummary, capacity_matrix, fidelity_by_fixture
from ditq.report.model import Candidate, RunData
from ditq.report.schema import Answer, ReasonCode, StandardName

__all__ = [
    "REASON_CODES",
    "STANDARDS",
    "STANDARD_RULES",
    "UNDECIDED_CODES",
    "Reason",
    "VerdictRules",
    "decide",
    "fit_answer",
    "parity_floor_db",
]


@dataclass(frozen=True)
class VerdictRules:
    # A candidate may be this much slower than BF16 at the same reference count before it counts as slower.
    slower_tolerance: float = 0.05
    # The parity band's floor is the reference pair's PSNR minus this margin (the seed's band was
    # 26-29 dB around a 27.6 dB BF16 pair; a 27.5 dB candidate sat inside it).
    parity_margin_db: float = 1.0
    # The reference pair's PSNR when compare.json states no band (``--parity-db``); None: no band.
    parity_reference_db: float | None = None
    # The objective every candidate's headline verdict answers: fit (to serve), speed (faster), memory (smaller).
    objective: Literal["fit", "speed", "memory"] = "fit"
    # The fidelity standard fit to serve uses: visually lossless (PSNR and SSIM thresholds) or the parity band.
    standard: StandardName = "lossless"


@dataclass(frozen=True)
class Reason:
    code: str
    message: str  # one sentence


# The codes a reason may carry: verdict.json's schema is where they are defined.
REASON_CODES: tuple[str, ...] = get_args(ReasonCode)
STANDARDS: tuple[StandardName, ...] = get_args(StandardName)  # lossless, parity
# Reasons that say the evidence is missing or inconclusive, not that the candidate is unfit.
UNDECIDED_CODES = frozenset(
    {
        "no_gate_result",
        "no_fidelity_result",
        "baseline_images",
        "baseline_collapsed",
        "undecided_parity_band",
        "undecided_lossless",
    }
)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _stage_reasons(candidate: Candidate, baseline: Candidate, rules: VerdictRules) -> list[Reason]:
    reasons = []
    for stage in candidate.failed_stages:
        code = "doctor_failure" if stage.name == "doctor" else "stage_failure"
        detail = (stage.message or "no message").rstrip(".")
        reasons.append(Reason(code, f"The {stage.name} step failed: {detail}."))
    doctor = candidate.doctor
    if doctor and not doctor.passed and not any(s.name == "doctor" for s in candidate.failed_stages):
        failing = ", ".join(doctor.failing) or "a kernel path"
        reasons.append(
            Reason(
                "doctor_failure",
                f"The doctor found kernel path(s) {failing} wrong against float32 on this device.",
            )
        )
    if candidate.run is None and not reasons:
        reasons.append(Reason("stage_failure", "The candidate was never probed, so nothing shows it serves."))
    return reasons


def _evidence_reasons(candidate: Candidate, baseline: Candidate, rules: VerdictRules) -> list[Reason]:
    """A run that is not complete (a write error stopped its probe, say) is partial evidence, whichever side."""
    reasons = []
    for who, run in (
        (f"The {candidate.name} run", candidate.run),
        (f"The {baseline.name} baseline", baseline.run),
    ):
        if run is not None and run.incomplete is not None:
            problem = run.incomplete.rstrip(".")
            reasons.append(
                Reason("incomplete_run", f"{who} is not complete ({problem}), so its evidence is partial.")
            )
    return reasons


def _request_reasons(candidate: Candidate, baseline: Candidate, rules: VerdictRules) -> list[Reason]:
    if candidate.run is None:
        return []
    reasons = []
    rows = capacity_matrix(candidate.run)
    for row in rows:
        if row.out_of_memory:
            records = candidate.run.records_with(row.n_references)
            modes = sorted({r.offload for r in records if r.out_of_memory and r.offload})
            where = f" with {' and '.join(modes)} offload" if modes else ""
            reasons.append(
                Reason(
                    "out_of_memory",
                    f"Out of memory at {_plural(row.n_references, 'reference')} "
                    f"({row.out_of_memory} of {row.requests} requests){where}.",
                )
            )
    failed = sum(row.failed for row in rows)
    if failed:
        first = next(r for r in candidate.run.records if not r.ok and not r.out_of_memory)
        why = (first.error or f"HTTP {first.http}").splitlines()[0][:160].rstrip(".")
        total = sum(row.requests for row in rows)
        reasons.append(Reason("failed_requests", f"{failed} of {total} requests failed (first: {why})."))
    return reasons


def _gate_reasons(candidate: Candidate, baseline: Candidate, rules: VerdictRules) -> list[Reason]:
    run = candidate.run
    if run is None:
        return []
    if run.gate is None:
        return [
            Reason(
                "no_gate_result",
                "No structure gate result exists for this run, so collapse is not ruled out.",
            )
        ]
    # A request that failed has its own reason (out of memory, failed requests); the gate judges images.
    served = {r.key for r in run.records if r.ok}
    judged = [g for g in run.gate if (g.fixture_id, g.seed) in served]
    failing = [g for g in judged if not g.passed]
    reasons = []
    if failing:
        signatures = sorted({name for g in failing for name in g.failures})
        named = f" ({', '.join(signatures)})" if signatures else ""
        reasons.append(
            Reason(
                "collapsed_outputs",
                f"Collapsed outputs: the structure gate failed {len(failing)} of {len(judged)} images{named}.",
            )
        )
    inherited = [g for g in judged if g.inherited]
    if inherited:
        shown = ", ".join(sorted({name for g in inherited for name in g.inherited}))
        reasons.append(
            Reason(
                "baseline_collapsed",
                f"The {baseline.name} baseline's own images show collapse signatures ({shown}) for "
                f"{len(inherited)} of {len(judged)} of these images, so the gate cannot tell a collapse "
                "apart from the model's own output.",
            )
        )
    return reasons


def parity_floor_db(candidate: Candidate, rules: VerdictRules) -> float | None:
    """The lowest PSNR (dB) inside the parity band: compare.json's band, else the rules'; None: no band."""
    parity = candidate.run.parity if candidate.run else None
    if parity is not None:
        return parity.floor_db
    if rules.parity_reference_db is not None:
        return rules.parity_reference_db - rules.parity_margin_db
    return None


def _fidelity_reasons(candidate: Candidate, baseline: Candidate, rules: VerdictRules) -> list[Reason]:
    copied = candidate.run.same_as_baseline if candidate.run else 0
    compared = sum(1 for r in (candidate.run.fidelity or []) if r.psnr_db is not None) if candidate.run else 0
    said = [Reason("baseline_images", f"{same_bytes_note(copied, compared)}.")] if copied else []
    if rules.standard == "lossless":
        return said + _lossless_reasons(candidate, baseline)
    return said + _parity_reasons(candidate, baseline, rules)


def _lossless_reasons(candidate: Candidate, baseline: Candidate) -> list[Reason]:
    """Each fixture's lossless decision from compare.json: outside is a reason against, undecided one for more
    evidence; a compare from before the standard says nothing about it."""
    run = candidate.run
    if run is None:
        return []
    decisions = {k: v.lossless for k, v in run.parity_fixtures.items() if v.lossless is not None}
    if not decisions:
        return [
            Reason(
                "no_fidelity_result",
                f"No image of this run was compared with the {baseline.name} baseline under the visually lossless "
                "standard (run ditq compare again).",
            )
        ]
    reasons = []
    for decision, code, words in (
        ("outside", "below_lossless", "Not visually lossless"),
        ("undecided", "undecided_lossless", "Not enough evidence whether it is visually lossless"),
    ):
        fixtures = [k for k, d in decisions.items() if d.decision == decision]
        if fixtures:
            detail = describe_lossless(decisions[fixtures[0]]).split(": ", 1)[1]
            reasons.append(Reason(code, f"{words} on {', '.join(fixtures)}: {detail}."))
    return reasons


def _parity_reasons(candidate: Candidate, baseline: Candidate, rules: VerdictRules) -> list[Reason]:
    run = candidate.run
    if run is None:
        return []
    summaries = {s.fixture_id: s for s in fidelity_by_fixture(run) if s.psnr_mean_db is not None}
    if not summaries:
        return [
            Reason(
                "no_fidelity_result", f"No image of this run was compared with the {baseline.name} baseline."
            )
        ]
    # compare.json decides each fixture on its interval; a file from before intervals marked each fixture
    # inside or outside by its mean. Missing images are not fidelity failures (a failed request has its own
    # reason), so the per-fixture decisions come first.
    decisions = {
        k: v.parity.decision if v.parity is not None else "inside" if v.inside_parity_band else "outside"
        for k, v in run.parity_fixtures.items()
        if v.parity is not None or v.inside_parity_band is not None
    }
    floor = parity_floor_db(candidate, rules)
    if not decisions and floor is None:
        return [
            Reason(
                "no_fidelity_result",
                "No parity band was stated (a BF16 reference pair or --parity-db), so fidelity is not judged.",
            )
        ]
    if not decisions and floor is not None:  # --parity-db given to the report, not to compare: worst mean
        worst = min(summaries.values(), key=lambda s: s.psnr_mean_db or math.inf)
        decisions = {worst.fixture_id: "outside" if (worst.psnr_mean_db or 0.0) < floor else "inside"}
    reasons = []
    for decision, code, words in (
        ("outside", "outside_parity_band", "Outside the parity band"),
        ("undecided", "undecided_parity_band", "Not enough evidence for the parity band"),
    ):
        fixtures = [k for k, d in decisions.items() if d == decision]
        if fixtures:
            reasons.append(
                Reason(
                    code,
                    f"{words} on {', '.join(fixtures)}: {_band_detail(run, fixtures[0], summaries, floor)}.",
                )
            )
    return reasons


def _band_detail(
    run: RunData, fixture_id: str, summaries: dict[str, FidelitySummary], floor: float | None
) -> str:
    """'PSNR against BF16 minus the pair's, -7.9 dB [-8.3, -7.5] over 4 seeds, floor -1 dB', or for a file from
    before intervals the mean against the band's floor."""
    entry = run.parity_fixtures.get(fixture_id)
    parity = entry.parity if entry is not None else None
    if parity is not None:  # "-7.9 dB [-8.3, -7.5] vs the pair over 4 seeds (floor -1 dB)", the decision said
        return describe_parity(parity).split(": ", 1)[1]
    mean = summaries[fixture_id].psnr_mean_db if fixture_id in summaries else None
    edge = entry.parity_edge_db if entry is not None and entry.parity_edge_db is not None else floor
    floor_text = f", below the band's floor of {edge:.1f} dB" if edge is not None else ""
    return f"PSNR averages {mean:.1f} dB{floor_text} (a mean, no interval)"


_RULES: tuple[Callable[[Candidate, Candidate, VerdictRules], list[Reason]], ...] = (
    _stage_reasons,
    _evidence_reasons,
    _request_reasons,
    _gate_reasons,
    _fidelity_reasons,
)


def decide(candidate: Candidate, baseline: Candidate, rules: VerdictRules | None = None) -> list[Reason]:
    """Every reason bearing on whether ``candidate`` is fit to serve; an empty list is a YES (see
    ``fit_answer``)."""
    rules = rules or VerdictRules()
    return [reason for rule in _RULES for reason in rule(candidate, baseline, rules)]


def fit_answer(reasons: list[Reason]) -> Answer:
    if any(r.code not in UNDECIDED_CODES for r in reasons):
        return "NO"
    return "UNDECIDED" if reasons else "YES"


# Each fidelity standard's rule, in words (verdict.json's ``standards``; the thresholds each compare used are in
# its intervals).
STANDARD_RULES: dict[StandardName, str] = {
    "lossless": (
        f"visually lossless: each fixture's mean PSNR against the baseline at least {LOSSLESS_PSNR_DB:g} dB and its "
        f"mean SSIM at least {LOSSLESS_SSIM:g}, each on its 95 % interval over seeds"
    ),
    "parity": (
        "parity: each fixture's PSNR against the baseline, seed by seed, at most the tolerance (1 dB) below what a "
        "second acceptable run of the model reaches, on its 95 % interval over seeds"
    ),
}
