"""Intervals and decisions: how sure a verdict is, from a handful of seeds.

Fidelity is judged on *paired* samples: per fixture and seed, the candidate's PSNR against the baseline and
the reference pair's PSNR against the baseline (the same picture, so a hard seed is hard for both); their
difference per seed is the sample. Speed is judged on the ratio of mean wall times (candidate / baseline), two
independent samples of requests, on the log scale (so that a ratio's interval stays positive).

Every interval is a percentile bootstrap with a fixed seed, so the same numbers give the same interval. With
few samples the plain percentile bootstrap is too narrow (at 4 seeds it behaves like a z interval on a
standard deviation that is itself too small), so it is *expanded* (Hesterberg, "What teachers should know
about the bootstrap", 2015): the percentiles are taken at the level whose normal quantile is
``sqrt(n / (n - 1)) * t_{n-1}``, which gives a Student-t-sized interval at small n and the ordinary one at
large n. A percentile bootstrap cannot reach past the sample's own range, though: at 4 samples the expanded
level asks for percentiles beyond the 1/256 chance of resampling one value four times, so the interval would
be the sample's min..max, which holds a symmetric spread's mean only 87.5 % of the time (1 - 2 / 2^4). So
every interval is at least Student's t interval on the same standard error, with n - 1 degrees of freedom
for one sample (or pairs) and Welch's for two independent ones (the bootstrap still widens the side a skewed
sample needs). With all samples equal the interval is that value (nothing varies, nothing is
uncertain).

A decision is taken on the interval, never on the estimate alone: inside the band when the interval's low end
clears the floor, outside when its high end does not reach it, undecided otherwise, together with about how
many samples would settle it (the interval narrowing as ``t_{n-1} / sqrt(n)`` at the spread measured now).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Literal

import numpy as np

__all__ = [
    "BOOTSTRAP_RESAMPLES",
    "BOOTSTRAP_SEED",
    "CONFIDENCE",
    "BandDecision",
    "Interval",
    "SpeedDecision",
    "band_decision",
    "difference_interval",
    "mean_interval",
    "ratio_interval",
    "samples_to_settle",
    "speed_decision",
    "t_quantile",
]

CONFIDENCE = 0.95  # two-sided
BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0
MAX_SAMPLES = 1000  # beyond this many seeds a decision counts as unsettleable

BandDecision = Literal["inside", "outside", "undecided"]
SpeedDecision = Literal["faster", "slower", "same", "undecided"]


@dataclass(frozen=True)
class Interval:
    """An estimate with its two-sided confidence interval over ``n`` samples (pairs, or the smaller side)."""

    estimate: float
    low: float
    high: float
    n: int
    method: str  # e.g. "paired bootstrap", "unpaired bootstrap"
    standard_error: float  # of the estimate, from the samples' spread (what more samples would shrink)
    confidence: float = CONFIDENCE
    log_scale: bool = False  # a ratio's: the interval and standard_error are taken on log(estimate)

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularized incomplete beta function (Lentz's method)."""
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    result = d
    for m in range(1, 300):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            result *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return result


def _incomplete_beta(a: float, b: float, x: float) -> float:
    if x <= 0.0 or x >= 1.0:
        return 0.0 if x <= 0.0 else 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def _t_cdf(t: float, df: float) -> float:
    tail = 0.5 * _incomplete_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """Student's t quantile (``p`` in (0.5, 1)), by bisection on its CDF."""
    low, high = 0.0, 1.0
    while _t_cdf(high, df) < p:
        high *= 2.0
    for _ in range(200):
        middle = (low + high) / 2.0
        low, high = (middle, high) if _t_cdf(middle, df) < p else (low, middle)
    return (low + high) / 2.0


def _expanded_level(n: int, confidence: float) -> float:
    """The percentile level of the expanded bootstrap: the confidence whose normal quantile is
    ``sqrt(n / (n - 1)) * t_{n-1}``."""
    z = math.sqrt(n / (n - 1)) * t_quantile(0.5 + confidence / 2, n - 1)
    return 2.0 * NormalDist().cdf(z) - 1.0


def _percentiles(draws: np.ndarray, n: int, confidence: float) -> tuple[float, float]:
    level = _expanded_level(n, confidence)
    low, high = np.quantile(draws, [(1 - level) / 2, (1 + level) / 2])
    return float(low), float(high)


def _at_least_t(
    estimate: float, low: float, high: float, error: float, df: float, confidence: float
) -> tuple[float, float]:
    """(low, high) widened to cover ``estimate +/- t_df * error`` (see the module's docstring)."""
    half = t_quantile(0.5 + confidence / 2, df) * error
    return min(low, estimate - half), max(high, estimate + half)


def _welch_df(parts: Sequence[tuple[float, int]]) -> float:
    """Welch-Satterthwaite degrees of freedom of a sum of independent variances ``(variance, n)``."""
    total = sum(v for v, _ in parts)
    spread = sum(v * v / (n - 1) for v, n in parts)
    return total * total / spread if spread > 0 else float(min(n for _, n in parts) - 1)


def _variance_of_mean(values: np.ndarray) -> float:
    return float(values.var(ddof=1)) / len(values)


def _resampled_means(values: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """(BOOTSTRAP_RESAMPLES,) means of resamples of ``values`` with replacement."""
    picks = rng.integers(0, len(values), size=(BOOTSTRAP_RESAMPLES, len(values)))
    return np.asarray(values[picks].mean(axis=1))


def mean_interval(
    values: Sequence[float], confidence: float = CONFIDENCE, method: str = "bootstrap"
) -> Interval:
    """The mean of ``values`` with its expanded percentile bootstrap interval (needs two values)."""
    sample = np.asarray(values, dtype=np.float64)
    if len(sample) < 2:
        raise ValueError(f"an interval needs at least 2 samples, got {len(sample)}")
    n, estimate = len(sample), float(sample.mean())
    error = float(sample.std(ddof=1)) / math.sqrt(n)
    if error == 0.0:
        return Interval(estimate, estimate, estimate, n, method, 0.0, confidence)
    draws = _resampled_means(sample, np.random.default_rng(BOOTSTRAP_SEED))
    low, high = _at_least_t(estimate, *_percentiles(draws, n, confidence), error, n - 1, confidence)
    return Interval(estimate, low, high, n, method, error, confidence)


def difference_interval(
    candidate: Mapping[int, float], reference: Mapping[int, float], confidence: float = CONFIDENCE
) -> Interval:
    """Mean of candidate - reference, seed by seed (``{seed: value}``).

    Paired when the reference has every seed the candidate has (the differences per seed are the sample);
    otherwise the two means' difference from independent resamples of each side (unpaired), e.g. when seeds
    were added to the candidate that the reference pair never ran.
    """
    if set(candidate) <= set(reference):
        differences = [candidate[seed] - reference[seed] for seed in sorted(candidate)]
        return mean_interval(differences, confidence, "paired bootstrap")
    return _unpaired_interval(list(candidate.values()), list(reference.values()), confidence)


def ratio_interval(
    candidate: Sequence[float], reference: Sequence[float], confidence: float = CONFIDENCE
) -> Interval:
    """mean(candidate) / mean(reference), from independent resamples of each side (e.g. wall times), taken on the
    log scale: the interval of log(mean(candidate)) - log(mean(reference)), at least Welch's t interval on its
    standard error (the delta method: the root of the sum of the means' squared relative errors), then
    exponentiated. A ratio of positive times stays positive at both ends (on the linear scale a wide interval
    crossed zero), and the interval is as far below the estimate, in ratio, as above it. The interval's
    ``standard_error`` is on the log scale (``log_scale``)."""
    ours, theirs = np.asarray(candidate, dtype=np.float64), np.asarray(reference, dtype=np.float64)
    n = min(len(ours), len(theirs))
    if n < 2:
        raise ValueError(
            f"an interval needs at least 2 samples on each side, got {len(ours)} and {len(theirs)}"
        )
    if min(ours.min(), theirs.min()) <= 0:
        raise ValueError("a ratio interval needs positive samples (times, sizes)")
    log_estimate = math.log(ours.mean()) - math.log(theirs.mean())
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    draws = np.log(_resampled_means(ours, rng)) - np.log(_resampled_means(theirs, rng))
    low, high = _percentiles(draws, n, confidence) if np.ptp(draws) > 0 else (log_estimate, log_estimate)
    parts = [(_variance_of_mean(side) / side.mean() ** 2, len(side)) for side in (ours, theirs)]
    error = math.sqrt(sum(v for v, _ in parts))
    low, high = _at_least_t(log_estimate, low, high, error, _welch_df(parts), confidence)
    return Interval(
        math.exp(log_estimate), math.exp(low), math.exp(high), n, "unpaired bootstrap, log scale", error,
        confidence, log_scale=True,
    )  # fmt: skip


def _unpaired_interval(candidate: Sequence[float], reference: Sequence[float], confidence: float) -> Interval:
    """mean(candidate) - mean(reference) from independent resamples of each side, at least Welch's t interval
    wide on its standard error (the root of the sum of the means' variances)."""
    ours, theirs = np.asarray(candidate, dtype=np.float64), np.asarray(reference, dtype=np.float64)
    n = min(len(ours), len(theirs))
    if n < 2:
        raise ValueError(
            f"an interval needs at least 2 samples on each side, got {len(ours)} and {len(theirs)}"
        )
    estimate = float(ours.mean() - theirs.mean())
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    draws = _resampled_means(ours, rng) - _resampled_means(theirs, rng)
    low, high = _percentiles(draws, n, confidence) if np.ptp(draws) > 0 else (estimate, estimate)
    parts = [(_variance_of_mean(side), len(side)) for side in (ours, theirs)]
    error = math.sqrt(sum(v for v, _ in parts))
    low, high = _at_least_t(estimate, low, high, error, _welch_df(parts), confidence)
    return Interval(estimate, low, high, n, "unpaired bootstrap", error, confidence)


def band_decision(interval: Interval, floor: float) -> BandDecision:
    """``interval`` of a difference against the lowest acceptable difference ``floor``."""
    if interval.low >= floor:
        return "inside"
    if interval.high < floor:
        return "outside"
    return "undecided"


def speed_decision(interval: Interval, tolerance: float) -> SpeedDecision:
    """``interval`` of a time ratio (candidate / baseline): slower when it lies above 1 + tolerance, faster
    below 1 - tolerance, the same when it lies within both, undecided when it straddles an edge."""
    if interval.low > 1 + tolerance:
        return "slower"
    if interval.high < 1 - tolerance:
        return "faster"
    if interval.low >= 1 - tolerance and interval.high <= 1 + tolerance:
        return "same"
    return "undecided"


def samples_to_settle(interval: Interval, edges: Sequence[float]) -> int | None:
    """About how many samples would make the interval clear the nearest of ``edges`` (a floor, or a speed
    tolerance's two edges): the smallest n whose ``t_{n-1}`` times the standard error, shrunk as
    ``sqrt(n_now / n)``, falls short of the estimate's distance to that edge. ``interval.n`` when the interval
    clears every edge already; None when the estimate sits on an edge, nothing varies, or more than
    MAX_SAMPLES would be needed."""
    if all(not (interval.low < edge < interval.high) for edge in edges):
        return interval.n
    scale = math.log if interval.log_scale else float  # a ratio's distances are taken where its error was
    gap = min(abs(scale(interval.estimate) - scale(edge)) for edge in edges)
    if gap == 0.0 or interval.standard_error == 0.0:
        return None
    critical = 0.5 + interval.confidence / 2

    def clears(n: int) -> bool:  # true from some n on: t_{n-1} and sqrt(n_now / n) both shrink as n grows
        return t_quantile(critical, n - 1) * interval.standard_error * math.sqrt(interval.n / n) < gap

    low, high = interval.n + 1, MAX_SAMPLES
    if low > high or not clears(high):
        return None
    while low < high:  # the smallest n that clears, by bisection
        middle = (low + high) // 2
        if clears(middle):
            high = middle
        else:
            low = middle + 1
    return low
