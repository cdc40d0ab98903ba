"""One answer per objective: fit to serve, faster, smaller; each YES, NO or UNDECIDED with its reasons and
the intervals behind it.

- **fit_to_serve**: the rules of ``ditq.report.verdict`` (stages, doctor, requests and memory, collapse,
  fidelity per fixture on its interval), under each fidelity standard (lossless, parity); the rules' standard is
  the headline's. An UNDECIDED answer that more seeds can decide carries the command that adds them.
- **faster**: per reference count both served, the ratio of mean warm wall times (candidate / baseline) with
  its interval, taken on the log scale (both ends positive): faster when it lies below 1 - tolerance, slower above
  1 + tolerance, the same within both. YES when faster at every count; NO when slower or the same at one;
  UNDECIDED otherwise, with the command that adds the requests it needs. Timed on a CPU, the reference kernels'
  times are not a speed measurement: UNDECIDED (``reference_kernels``), the ratios shown for information, the
  command the same sweep on a GPU. Like is compared with
  like: where the two were served on different numbers of devices (``--parallel``), each wall time is multiplied by
  its server's devices first, so the ratio is of device-seconds per image (per-device throughput), and says so.
- **smaller**: the quantized components' weight bytes against the source's, and the run's peak memory against
  the baseline's; both measured once, so no interval. YES when the weights are smaller and the peak is not
  larger; NO when either is larger; UNDECIDED when the weights are not known.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

from ditq.judge.stats import ratio_interval, samples_to_settle, speed_decision
from ditq.report.capacity import devices_used, timed_walls
from ditq.report.model import Candidate
from ditq.report.schema import (
    Answer,
    IntervalEntry,
    ObjectiveAnswer,
    Objectives,
    ReasonEntry,
    ServingProfile,
)
from ditq.report.settle import settle_command, speed_settle_command
from ditq.report.verdict import STANDARDS, Reason, VerdictRules, decide, fit_answer

__all__ = ["fidelity_intervals", "fit_by_standard", "objectives", "size_answer", "speed_answer"]


def _entries(reasons: list[Reason]) -> list[ReasonEntry]:
    return [ReasonEntry(code=r.code, message=r.message) for r in reasons]  # type: ignore[arg-type]


def fidelity_intervals(candidate: Candidate, standard: str = "parity") -> list[IntervalEntry]:
    """compare.json's per-fixture decisions under ``standard``, as intervals: the parity band's (PSNR minus the
    reference's), or the lossless standard's (PSNR and SSIM, each against its threshold)."""
    if candidate.run is None:
        return []
    if standard == "lossless":
        return _lossless_intervals(candidate)
    out = []
    for fixture_id, entry in candidate.run.parity_fixtures.items():
        parity = entry.parity
        if parity is None:
            continue
        reference = "the reference pair's" if parity.reference == "pair" else "the stated band's"
        out.append(
            IntervalEntry(
                subject=f"{fixture_id} (PSNR minus {reference})",
                measure="psnr_minus_reference_db",
                estimate=parity.difference_db,
                low=parity.low_db,
                high=parity.high_db,
                confidence=parity.confidence if parity.low_db is not None else None,
                n=parity.n,
                method=parity.method,
                threshold=f"floor {parity.floor_db:+g} dB",
                decision=parity.decision,
                samples_to_settle=parity.seeds_to_settle,
                samples_added=candidate.seeds_added.get(fixture_id),
            )
        )
    return out


def _lossless_intervals(candidate: Candidate) -> list[IntervalEntry]:
    assert candidate.run is not None
    out = []
    for fixture_id, entry in candidate.run.parity_fixtures.items():
        decision = entry.lossless
        if decision is None:
            continue
        for measure, name, unit in ((decision.psnr_db, "psnr_db", " dB"), (decision.ssim, "ssim", "")):
            out.append(
                IntervalEntry(
                    subject=f"{fixture_id} ({'PSNR' if name == 'psnr_db' else 'SSIM'})",
                    measure=name,  # type: ignore[arg-type]
                    estimate=measure.estimate,
                    low=measure.low,
                    high=measure.high,
                    confidence=decision.confidence if measure.low is not None else None,
                    n=decision.n,
                    method=decision.method,
                    threshold=f"at least {measure.threshold:g}{unit}",
                    decision=measure.decision,
                    samples_to_settle=measure.seeds_to_settle,
                    samples_added=candidate.seeds_added.get(fixture_id),
                )
            )
    return out


def fit_by_standard(
    candidate: Candidate, baseline: Candidate, rules: VerdictRules
) -> dict[str, tuple[list[Reason], ObjectiveAnswer]]:
    """Fit to serve under each fidelity standard: its reasons and its answer, with the settling command of an
    UNDECIDED one."""
    out: dict[str, tuple[list[Reason], ObjectiveAnswer]] = {}
    for standard in STANDARDS:
        reasons = decide(candidate, baseline, replace(rules, standard=standard))
        intervals = fidelity_intervals(candidate, standard)
        answer = fit_answer(reasons)
        command = settle_command(candidate, baseline, intervals, standard) if answer == "UNDECIDED" else None
        out[standard] = (
            reasons,
            ObjectiveAnswer(
                answer=answer, reasons=_entries(reasons), intervals=intervals, settle_command=command
            ),
        )
    return out


def _ratio_text(entry: IntervalEntry, of: str) -> str:
    """'0.78× [0.41, 1.50] float32's time (4 requests)': a time ratio, always the candidate's over ``of``'s."""
    if entry.low is None or entry.high is None:
        return f"{entry.estimate:.2f}× {of} (one request each, no interval)"
    return f"{entry.estimate:.2f}× [{entry.low:.2f}, {entry.high:.2f}] {of} ({entry.n} requests)"


def on_cpu(candidate: Candidate) -> bool:
    """The candidate's images were made on a CPU: its timings are reference kernels', not a speed measurement."""
    return candidate.run is not None and (candidate.run.device or "").startswith("cpu")


REFERENCE_KERNELS = "reference kernels: not a speed measurement"  # what CPU timings are, said where shown


def _speed_intervals(
    candidate: Candidate, baseline: Candidate, rules: VerdictRules
) -> tuple[list[IntervalEntry], tuple[int, int]]:
    """Per reference count both served, the interval of the candidate's time over the baseline's; and the devices
    each served on (device-seconds where they differ: per-device throughput, like with like)."""
    if candidate.run is None or baseline.run is None:
        return [], (1, 1)
    devices = (devices_used(candidate.run.records), devices_used(baseline.run.records))
    measure: Literal["time_ratio", "device_time_ratio"] = (
        "time_ratio" if devices[0] == devices[1] else "device_time_ratio"
    )
    intervals = []
    for k in candidate.run.reference_counts:
        ours, _ = timed_walls([r for r in candidate.run.records_with(k) if r.ok])
        theirs, _ = timed_walls([r for r in baseline.run.records_with(k) if r.ok])
        if ours and theirs:
            if measure == "device_time_ratio":
                ours, theirs = [w * devices[0] for w in ours], [w * devices[1] for w in theirs]
            intervals.append(_speed_interval(k, ours, theirs, rules.slower_tolerance, measure))
    return intervals, devices


def _speed_reasons(
    intervals: list[IntervalEntry], devices: tuple[int, int], baseline: Candidate, rules: VerdictRules
) -> list[Reason]:
    """A sentence per decision that occurs: at which reference counts, and the first one's ratio."""
    reasons, whose = [], f"{baseline.name}'s"
    measured = (
        "seconds per image"
        if devices[0] == devices[1]
        else f"device-seconds per image (seconds x {devices[0]} device(s) for it, x {devices[1]} for "
        f"{baseline.name}: per-device throughput)"
    )
    for decision, code, words in (
        ("slower", "slower_than_baseline", "Slower than"),
        ("same", "same_speed_as_baseline", "As fast as, not faster than,"),
        ("undecided", "undecided_speed", "Not enough evidence whether it is faster than"),
        ("faster", "faster_than_baseline", "Faster than"),
    ):
        chosen = [e for e in intervals if e.decision == decision]
        if chosen:
            counts = ", ".join(e.subject.split()[0] for e in chosen)
            message = (
                f"{words} {baseline.name} at {counts} reference(s): {measured} "
                f"{_ratio_text(chosen[0], whose)} at {chosen[0].subject} (tolerance {rules.slower_tolerance:.0%})"
            )
            if decision == "undecided":
                settle = chosen[0].samples_to_settle
                message += f"; about {settle} requests would settle it" if settle else ""
            reasons.append(Reason(code, message + "."))
    return reasons


def speed_answer(candidate: Candidate, baseline: Candidate, rules: VerdictRules) -> ObjectiveAnswer:
    intervals, devices = _speed_intervals(candidate, baseline, rules)
    if not intervals:
        reason = Reason(
            "no_speed_comparison", f"No reference count was served by both it and {baseline.name}."
        )
        return ObjectiveAnswer(answer="UNDECIDED", reasons=_entries([reason]), intervals=[])
    if on_cpu(candidate) or on_cpu(baseline):  # the reference kernels' times: shown, never an answer
        first, whose = intervals[0], f"{baseline.name}'s time"
        reason = Reason(
            "reference_kernels",
            f"Timed on a CPU ({REFERENCE_KERNELS}): seconds per image {_ratio_text(first, whose)} at "
            f"{first.subject}, shown for information only; the same run on a GPU answers it.",
        )
        command = speed_settle_command(candidate, baseline, intervals, gpu=True)
        return ObjectiveAnswer(
            answer="UNDECIDED", reasons=_entries([reason]), intervals=intervals, settle_command=command
        )
    decisions = {e.decision for e in intervals}
    answer: Answer = (
        "NO" if decisions & {"slower", "same"} else "UNDECIDED" if "undecided" in decisions else "YES"
    )
    command = speed_settle_command(candidate, baseline, intervals) if answer == "UNDECIDED" else None
    reasons = _speed_reasons(intervals, devices, baseline, rules)
    return ObjectiveAnswer(
        answer=answer, reasons=_entries(reasons), intervals=intervals, settle_command=command
    )


def _speed_interval(
    k: int,
    ours: list[float],
    theirs: list[float],
    tolerance: float,
    measure: Literal["time_ratio", "device_time_ratio"],
) -> IntervalEntry:
    subject = f"{k} reference{'' if k == 1 else 's'}"
    threshold = f"1 +/- {tolerance:g}"
    if min(len(ours), len(theirs)) < 2:
        estimate = (sum(ours) / len(ours)) / (sum(theirs) / len(theirs))
        return IntervalEntry(
            subject=subject, measure=measure, estimate=round(estimate, 4), low=None, high=None,
            confidence=None, n=min(len(ours), len(theirs)), method="measured once", threshold=threshold,
            decision="undecided", samples_to_settle=None,
        )  # fmt: skip
    interval = ratio_interval(ours, theirs)
    return IntervalEntry(
        subject=subject,
        measure=measure,
        estimate=round(interval.estimate, 4),
        low=round(interval.low, 4),
        high=round(interval.high, 4),
        confidence=interval.confidence,
        n=interval.n,
        method=interval.method,
        threshold=threshold,
        decision=speed_decision(interval, tolerance),
        samples_to_settle=samples_to_settle(interval, [1 - tolerance, 1 + tolerance]),
    )


def _measured_once(subject: str, measure: str, ratio: float, decision: str) -> IntervalEntry:
    return IntervalEntry.model_validate(
        {
            "subject": subject,
            "measure": measure,
            "estimate": round(ratio, 4),
            "low": None,
            "high": None,
            "confidence": None,
            "n": None,
            "method": "measured once",
            "threshold": "1",
            "decision": decision,
            "samples_to_settle": None,
        }
    )


def size_answer(profile: ServingProfile, baseline: ServingProfile, baseline_name: str) -> ObjectiveAnswer:
    if profile.weight_bytes is None or not baseline.weight_bytes:
        reason = Reason(
            "no_memory_comparison", "The weight bytes of the candidate or the source are not known."
        )
        return ObjectiveAnswer(answer="UNDECIDED", reasons=_entries([reason]), intervals=[])
    weights = profile.weight_bytes / baseline.weight_bytes
    intervals = [_measured_once("weights", "weight_ratio", weights, "smaller" if weights < 1 else "larger")]
    reasons = [
        Reason(
            "smaller_weights" if weights < 1 else "larger_weights",
            f"Weights {weights:.2f}× {baseline_name}'s ({profile.weight_bytes} vs {baseline.weight_bytes} bytes).",
        )
    ]
    larger_peak = False
    if profile.peak_memory_bytes and baseline.peak_memory_bytes:
        peak = profile.peak_memory_bytes / baseline.peak_memory_bytes
        larger_peak = peak > 1
        intervals.append(
            _measured_once(
                "peak memory", "peak_memory_ratio", peak, "larger" if larger_peak else "not larger"
            )
        )
        if larger_peak:
            reasons.append(
                Reason("larger_peak_memory", f"Peak memory {peak:.2f}× {baseline_name}'s, measured once.")
            )
    answer: Answer = "YES" if weights < 1 and not larger_peak else "NO"
    return ObjectiveAnswer(answer=answer, reasons=_entries(reasons), intervals=intervals)


def objectives(
    candidate: Candidate,
    baseline: Candidate,
    fits: dict[str, tuple[list[Reason], ObjectiveAnswer]],
    profile: ServingProfile,
    baseline_profile: ServingProfile,
    rules: VerdictRules,
) -> Objectives:
    """Every objective's answer; ``fits`` is ``fit_by_standard``'s, the rules' standard heading fit to serve."""
    return Objectives(
        fit_to_serve=fits[rules.standard][1],
        fit_by_standard={name: answer for name, (_, answer) in fits.items()},  # type: ignore[misc]
        faster=speed_answer(candidate, baseline, rules),
        smaller=size_answer(profile, baseline_profile, baseline.name),
    )
