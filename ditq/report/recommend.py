"""Which candidate to serve, and one sentence on each of the others.

Only a candidate fit to serve under the document's standard is recommended. Among those, the one that serves the
most reference counts, then is decided faster than the baseline, then has the fewest weight bytes (to 1 % of the
baseline's), then the highest mean PSNR against the baseline, then the fewest seconds per image: a speed
difference that the intervals do not decide is not a reason to prefer one candidate.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

from ditq.report.schema import Recommendation, ServingProfile
from ditq.report.verdict import VerdictRules

if TYPE_CHECKING:
    from ditq.report.assess import Assessment

__all__ = ["recommend"]

_STANDARD_WORDS = {"lossless": "visually lossless", "parity": "inside the parity band"}


def _seconds(profile: ServingProfile) -> float | None:
    values = list(profile.seconds_per_image.values())
    return statistics.fmean(values) if values else None


def _psnr(profile: ServingProfile) -> float | None:
    values = [r.psnr_mean_db for r in profile.by_references if r.psnr_mean_db is not None]
    return statistics.fmean(values) if values else None


def _rank(a: Assessment, baseline: ServingProfile) -> tuple[float, ...]:
    seconds, psnr = _seconds(a.profile), _psnr(a.profile)
    weights = (
        round(a.profile.weight_bytes / baseline.weight_bytes, 2)
        if a.profile.weight_bytes is not None and baseline.weight_bytes
        else float("inf")
    )
    return (
        -a.profile.max_references_served,
        0.0 if a.objectives.faster.answer == "YES" else 1.0,
        weights,
        -(psnr if psnr is not None else float("-inf")),
        seconds if seconds is not None else float("inf"),
    )


def _facts(a: Assessment, baseline: ServingProfile) -> str:
    """'serves 1-4 references, 0.52x the baseline's weights, 1.23 s per image, 43.1 dB mean PSNR'."""
    served = [r.references for r in a.profile.by_references if r.requests and r.served == r.requests]
    parts = []
    if served:
        low, high = min(served), max(served)
        parts.append(f"serves {low}-{high} references" if low != high else f"serves {low} references")
    if a.profile.weight_bytes and baseline.weight_bytes:
        parts.append(f"{a.profile.weight_bytes / baseline.weight_bytes:.2f}x the baseline's weights")
    seconds, psnr = _seconds(a.profile), _psnr(a.profile)
    if seconds is not None:
        parts.append(f"{seconds:.2f} s per image")
    if psnr is not None:
        parts.append(f"{psnr:.1f} dB mean PSNR against the baseline")
    return ", ".join(parts)


def _why_not(a: Assessment, chosen: Assessment | None, baseline: ServingProfile) -> str:
    fit = a.objectives.fit_to_serve
    if fit.answer == "YES" and chosen is not None:
        return f"Fit to serve too, ranked after {chosen.candidate.name}: {_facts(a, baseline)}."
    first = fit.reasons[0].message if fit.reasons else "no reason recorded."
    text = f"{fit.answer}: {first}"
    if fit.answer == "UNDECIDED" and fit.settle_command:
        text += f" To settle it: {fit.settle_command}"
    return text


def recommend(assessments: list[Assessment], baseline: ServingProfile, rules: VerdictRules) -> Recommendation:
    """The candidate to serve (None: none is fit), why, and why not each other one."""
    if not assessments:
        return Recommendation(candidate=None, why="No candidate was judged.", others={})
    words = _STANDARD_WORDS[rules.standard]
    fit = sorted(
        (a for a in assessments if a.objectives.fit_to_serve.answer == "YES"),
        key=lambda a: _rank(a, baseline),
    )
    chosen = fit[0] if fit else None
    others = {a.candidate.name: _why_not(a, chosen, baseline) for a in assessments if a is not chosen}
    if chosen is None:
        undecided = [a.candidate.name for a in assessments if a.objectives.fit_to_serve.answer == "UNDECIDED"]
        why = (
            f"No candidate is fit to serve ({words} on every fixture, within the memory budget, no collapse)"
        )
        why += (
            f"; {', '.join(undecided)}: UNDECIDED, the evidence so far cannot tell (each says why)."
            if undecided
            else "."
        )
        return Recommendation(candidate=None, why=why, others=others)
    ranked = (
        f" (first of the {len(fit)} fit to serve by references served, decided speed, weights, then fidelity)"
        if len(fit) > 1
        else ""
    )
    why = f"Serve {chosen.candidate.name}: fit to serve, {words} on every fixture{ranked}; {_facts(chosen, baseline)}."
    return Recommendation(candidate=chosen.candidate.name, why=why, others=others)
