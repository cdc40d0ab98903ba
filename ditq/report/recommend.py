"""Which candidate to serve, and one sentence on each of the others.

Only a candidate fit to serve under the document's standard is recommended. Among those, the one that serves the
most reference counts, then is decided faster than the baseline, then has the fewest weight bytes (to 1 % of the
baseline's), then the highest mean PSNR against the baseline, then the fewest seconds per image: a speed
difference that the intervals do not decide is not a reason to prefer one candidate. Timings made on a CPU (the
reference kernels) take no part in the ranking at all, and are shown with the baseline's beside them and what they
are.

The sentence names what decided: the objective (fit to serve, under its standard) and, among several fit to serve,
the first criterion of the ranking that told the chosen one from the next.
"""

from __future__ import annotations

import statistics

from ditq.report.assessment import Assessment
from ditq.report.objectives import REFERENCE_KERNELS, on_cpu
from ditq.report.schema import Recommendation, ServingProfile
from ditq.report.verdict import VerdictRules

__all__ = ["recommend"]

_STANDARD_WORDS = {"lossless": "visually lossless", "parity": "inside the parity band"}
# the ranking's criteria, in order, as the sentence names the one that decided
_CRITERIA = ("references served", "decided speed", "weights", "fidelity (mean PSNR)", "seconds per image")


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
    timed = seconds is not None and not on_cpu(a.candidate)  # a CPU's reference kernels rank nothing
    return (
        -a.profile.max_references_served,
        0.0 if a.objectives.faster.answer == "YES" else 1.0,
        weights,
        -(psnr if psnr is not None else float("-inf")),
        seconds if timed and seconds is not None else float("inf"),
    )


def _times(a: Assessment, baseline: ServingProfile, baseline_name: str) -> str | None:
    """'11.12 s per image against float32's 3.30 s (CPU, reference kernels: not a speed measurement)'."""
    seconds, theirs = _seconds(a.profile), _seconds(baseline)
    if seconds is None:
        return None
    text = f"{seconds:.2f} s per image"
    text += f" against {baseline_name}'s {theirs:.2f} s" if theirs is not None else ""
    return text + (f" (CPU, {REFERENCE_KERNELS})" if on_cpu(a.candidate) else "")


def _facts(a: Assessment, baseline: ServingProfile, baseline_name: str) -> str:
    """'serves 1-4 references, 0.52× the baseline's weights, 43.1 dB mean PSNR against the baseline, 1.23 s per
    image against BF16's 1.40 s'."""
    served = [r.references for r in a.profile.by_references if r.requests and r.served == r.requests]
    parts = []
    if served:
        low, high = min(served), max(served)
        parts.append(f"serves {low}-{high} references" if low != high else f"serves {low} references")
    if a.profile.weight_bytes and baseline.weight_bytes:
        parts.append(f"{a.profile.weight_bytes / baseline.weight_bytes:.2f}× the baseline's weights")
    psnr = _psnr(a.profile)
    if psnr is not None:
        parts.append(f"{psnr:.1f} dB mean PSNR against the baseline")
    times = _times(a, baseline, baseline_name)
    return ", ".join([*parts, *([times] if times else [])])


def _why_not(a: Assessment, chosen: Assessment | None, baseline: ServingProfile, baseline_name: str) -> str:
    fit = a.objectives.fit_to_serve
    if fit.answer == "YES" and chosen is not None:
        return (
            f"Fit to serve too, ranked after {chosen.candidate.name}: {_facts(a, baseline, baseline_name)}."
        )
    first = fit.reasons[0].message if fit.reasons else "no reason recorded."
    text = f"{fit.answer}: {first}"
    if fit.answer == "UNDECIDED" and fit.settle_command:
        text += f" To settle it: {fit.settle_command}"
    return text


def _decided_by(fit: list[Assessment], baseline: ServingProfile) -> str:
    """Among several fit to serve: the first criterion that told the first from the second."""
    first, second = _rank(fit[0], baseline), _rank(fit[1], baseline)
    criterion = next((name for name, a, b in zip(_CRITERIA, first, second, strict=True) if a != b), None)
    how = f"decided by {criterion}" if criterion else "tied on every criterion, the first listed"
    return f"first of the {len(fit)} fit to serve, {how}"


def recommend(
    assessments: list[Assessment],
    baseline: ServingProfile,
    rules: VerdictRules,
    baseline_name: str = "the baseline",
) -> Recommendation:
    """The candidate to serve (None: none is fit), why (the deciding objective, the baseline's time beside the
    candidate's), and why not each other one."""
    if not assessments:
        return Recommendation(candidate=None, why="No candidate was judged.", others={})
    words = _STANDARD_WORDS[rules.standard]
    fit = sorted(
        (a for a in assessments if a.objectives.fit_to_serve.answer == "YES"),
        key=lambda a: _rank(a, baseline),
    )
    chosen = fit[0] if fit else None
    others = {
        a.candidate.name: _why_not(a, chosen, baseline, baseline_name) for a in assessments if a is not chosen
    }
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
    ranked = f"; {_decided_by(fit, baseline)}" if len(fit) > 1 else ""
    why = (
        f"Serve {chosen.candidate.name}: decided on fit to serve ({words} on every fixture, within the memory "
        f"budget, no collapse){ranked}; {_facts(chosen, baseline, baseline_name)}."
    )
    return Recommendation(candidate=chosen.candidate.name, why=why, others=others)
