"""Fidelity against the baseline: PSNR, SSIM (and LPIPS where its weights are on disk), per image.

For every successful baseline record, the candidate image with the same fixture
and seed is compared: RGBA with RGBA when both images carry alpha, otherwise
both composited over white. A missing candidate image is a ``missing`` row; a
size mismatch is an ``error`` row. Per fixture: mean, min, max.

The parity band answers "is this as close as two acceptable BF16 runs are to each
other?": a reference pair (two BF16 runs of different implementations or settings, the
first of them the baseline) gives the PSNR two acceptable runs reach per fixture and seed;
a number the user states stands in for it, without a spread. Per fixture, the candidate's
PSNR minus the pair's, seed by seed, is a paired sample; the fixture is inside when the
interval of its mean (``ditq.judge.stats``) clears minus the tolerance, outside when it does
not reach it, and undecided otherwise, with about how many seeds would settle it.

The visually lossless standard answers "would a viewer see a difference?" with stated thresholds instead of a
second run: per fixture, the intervals of the mean PSNR and the mean SSIM over seeds must clear
``LOSSLESS_PSNR_DB`` and ``LOSSLESS_SSIM`` (``docs/cli/report.md`` gives their source). Both are computed for
every compare; the report's ``--standard`` picks the one its headline uses.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ditq.errors import InputError
from ditq.judge.stats import (
    CONFIDENCE,
    BandDecision,
    band_decision,
    difference_interval,
    mean_interval,
    samples_to_settle,
)
from ditq.metrics import fidelity_arrays, load_png_array, psnr, ssim
from ditq.pictures import read_picture_bytes
from ditq.probe.records import changed_fixtures, find_image, is_success, latest_by_key, read_records
from ditq.runfiles import (
    RECORDS_FILE,
    CompareFile,
    CompareRow,
    FidelityOverall,
    FidelityStats,
    FixtureFidelity,
    LosslessDecision,
    LosslessMeasure,
    LosslessResult,
    ParityDecision,
    ParityResult,
    ProbeRecord,
)

__all__ = [
    "LOSSLESS_PSNR_DB",
    "LOSSLESS_SSIM",
    "MAX_SEEDS",
    "PSNR_CAP_DB",
    "TOLERANCE_DB",
    "LosslessStandard",
    "ParityBand",
    "compare_run",
    "describe_lossless",
    "describe_parity",
    "format_compare",
    "identical_images",
    "lpips_scorer",
    "parity_from_pair",
    "same_bytes_note",
    "seeds_to_add",
    "settle_seeds",
]

log = logging.getLogger(__name__)

TOLERANCE_DB = 1.0  # how far below the parity band still counts (dB), unless told otherwise
MAX_SEEDS = 16  # the most seeds seeds_to_add gives a fixture, unless told otherwise
PSNR_CAP_DB = 100.0  # identical images (infinite PSNR) are reported at this value so means stay finite
LOSSLESS_PSNR_DB = 40.0  # visually lossless: the mean PSNR per fixture (dB) must clear this ...
LOSSLESS_SSIM = 0.98  # ... and the mean SSIM this, each on its interval over seeds
_ALEXNET_WEIGHTS = "alexnet-owt-7be5be79.pth"  # what torchvision (and so lpips) loads for AlexNet

LpipsScorer = Callable[[np.ndarray, np.ndarray], float]


def lpips_scorer() -> tuple[LpipsScorer | None, str]:
    """(scorer, note). The scorer exists only when the lpips package and the AlexNet weights are local."""
    if importlib.util.find_spec("lpips") is None:
        return None, "lpips skipped: the lpips package is not installed"
    import torch

    weights = Path(torch.hub.get_dir()) / "checkpoints" / _ALEXNET_WEIGHTS
    if not weights.is_file():
        return None, f"lpips skipped: AlexNet weights not found at {weights} (they are never downloaded)"
    import lpips

    network = lpips.LPIPS(net="alex", verbose=False).eval()

    def score(a: np.ndarray, b: np.ndarray) -> float:
        def tensor(x: np.ndarray) -> torch.Tensor:  # (H, W, 3) uint8 -> (1, 3, H, W) in [-1, 1]
            return torch.from_numpy(x[..., :3].astype(np.float32) / 127.5 - 1.0).permute(2, 0, 1)[None]

        with torch.no_grad():
            return float(network(tensor(a), tensor(b)).item())

    return score, "lpips: AlexNet"


@dataclass(frozen=True)
class ParityBand:
    source: str  # "pair A vs B" or "stated"
    overall_db: float
    per_fixture_db: dict[str, float]  # the pair's mean PSNR per fixture
    tolerance_db: float
    per_seed_db: dict[str, dict[int, float]] = field(default_factory=dict)  # a pair's PSNR per fixture, seed

    def edge(self, fixture_id: str | None) -> float:
        value = self.per_fixture_db.get(fixture_id, self.overall_db) if fixture_id else self.overall_db
        return value - self.tolerance_db

    def decide(self, fixture_id: str, psnr_by_seed: dict[int, float]) -> ParityDecision:
        """The fixture's candidate PSNR per seed against the pair's (paired), or against the stated PSNR."""
        pair = self.per_seed_db.get(fixture_id, {})
        reference = (
            pair if len(pair) >= 2 else dict.fromkeys(psnr_by_seed, self.edge(fixture_id) + self.tolerance_db)
        )
        common: dict[str, Any] = {
            "reference": "pair" if len(pair) >= 2 else "stated",
            "confidence": CONFIDENCE,
            "floor_db": -self.tolerance_db,
            "n": len(psnr_by_seed),
        }
        if len(psnr_by_seed) < 2:  # one image says nothing about the spread
            return ParityDecision.model_validate(
                {**common, "difference_db": None, "low_db": None, "high_db": None, "seeds_to_settle": None,
                 "method": "none", "decision": "undecided"}
            )  # fmt: skip
        interval = difference_interval(psnr_by_seed, reference)
        method = interval.method if len(pair) >= 2 else "bootstrap against a stated PSNR"
        return ParityDecision(
            **common,
            difference_db=round(interval.estimate, 3),
            low_db=round(interval.low, 3),
            high_db=round(interval.high, 3),
            method=method,
            decision=band_decision(interval, -self.tolerance_db),
            seeds_to_settle=samples_to_settle(interval, [-self.tolerance_db]),
        )


@dataclass(frozen=True)
class LosslessStandard:
    """Visually lossless: each fixture's mean PSNR and mean SSIM over seeds above stated thresholds, each decided
    on its interval (``ditq.judge.stats.mean_interval``)."""

    psnr_db: float = LOSSLESS_PSNR_DB
    ssim: float = LOSSLESS_SSIM

    def _measure(
        self, values: list[float], threshold: float, digits: int, most: float
    ) -> tuple[LosslessMeasure, int | None]:
        """One measure's decision; ``most`` is the highest value it can take (the interval is clipped to it)."""
        if len(values) < 2:
            estimate = round(statistics.fmean(values), digits) if values else None
            return LosslessMeasure(
                estimate=estimate, low=None, high=None, threshold=threshold, decision="undecided",
                seeds_to_settle=None,
            ), None  # fmt: skip
        interval = mean_interval(values)
        interval = replace(interval, high=min(interval.high, most))
        decision = band_decision(interval, threshold)
        settle = samples_to_settle(interval, [threshold])
        return LosslessMeasure(
            estimate=round(interval.estimate, digits),
            low=round(interval.low, digits),
            high=round(interval.high, digits),
            threshold=threshold,
            decision=decision,
            seeds_to_settle=settle,
        ), settle

    def decide(self, psnr_by_seed: dict[int, float], ssim_by_seed: dict[int, float]) -> LosslessDecision:
        """The fixture's decision: outside when either measure is, inside when both are, else undecided with
        the seeds the undecided measures need (the most of them)."""
        psnr_measure, psnr_settle = self._measure(list(psnr_by_seed.values()), self.psnr_db, 3, PSNR_CAP_DB)
        ssim_measure, ssim_settle = self._measure(list(ssim_by_seed.values()), self.ssim, 5, 1.0)
        decisions = {psnr_measure.decision, ssim_measure.decision}
        decision: BandDecision = (
            "outside" if "outside" in decisions else "inside" if decisions == {"inside"} else "undecided"
        )
        n = min(len(psnr_by_seed), len(ssim_by_seed))
        settle: int | None = n
        if decision == "undecided":
            needs = [
                (m.decision, s) for m, s in ((psnr_measure, psnr_settle), (ssim_measure, ssim_settle))
                if m.decision == "undecided"
            ]  # fmt: skip
            settle = None if any(s is None for _, s in needs) else max(s for _, s in needs if s is not None)
        return LosslessDecision(
            psnr_db=psnr_measure,
            ssim=ssim_measure,
            confidence=CONFIDENCE,
            method="bootstrap" if n >= 2 else "none",
            n=n,
            decision=decision,
            seeds_to_settle=settle,
        )

    def decide_rows(self, ok: Sequence[CompareRow]) -> LosslessDecision | None:
        """``decide`` over one fixture's ok rows (their PSNR and SSIM by seed); None when they measured neither."""
        psnr = {r.seed: r.psnr_db for r in ok if r.psnr_db is not None}
        ssim = {r.seed: r.ssim for r in ok if r.ssim is not None}
        return self.decide(psnr, ssim) if psnr and ssim else None


def _stats(values: list[float], digits: int) -> FidelityStats:
    if not values:
        return FidelityStats(mean=None, min=None, max=None)
    return FidelityStats(
        mean=round(statistics.fmean(values), digits),
        min=round(min(values), digits),
        max=round(max(values), digits),
    )


def _recorded_image(path: Path, record: ProbeRecord | None) -> tuple[bytes, np.ndarray, str] | str:
    """(bytes, pixels, mode) of the image file, or why it is not evidence: it cannot be read or decoded, or it is
    not the image its record names (its sha256 differs from the record's: swapped or edited since)."""
    try:
        data = read_picture_bytes(path)
        pixels, mode = load_png_array(data)
    except Exception as error:  # an unreadable file is a row of its own, not the end of the comparison
        return f"cannot be decoded ({type(error).__name__})"
    if record is not None and record.sha256 and hashlib.sha256(data).hexdigest() != record.sha256:
        return "is not the one its record names (sha256 differs)"
    return data, pixels, mode


def _compare_pair(
    candidate: Path,
    reference: Path,
    scorer: LpipsScorer | None,
    records: tuple[ProbeRecord | None, ProbeRecord] | None = None,
) -> dict[str, Any]:
    """The row's fields: status ok with PSNR, SSIM, the space compared in (and LPIPS; ``same_bytes`` where the
    two files are one image byte for byte), else status error. ``records``: (the candidate's, the baseline's)
    record of the pair, whose sha256 each image must be."""
    ours, theirs = records or (None, None)
    reference_image = _recorded_image(reference, theirs)
    if isinstance(reference_image, str):
        return {"status": "error", "error": f"baseline image {reference_image}"}
    candidate_image = _recorded_image(candidate, ours)
    if isinstance(candidate_image, str):
        return {"status": "error", "error": f"image {candidate_image}"}
    (reference_data, a, a_mode), (candidate_data, b, b_mode) = reference_image, candidate_image
    if a.shape[:2] != b.shape[:2]:
        return {
            "status": "error",
            "error": f"size {b.shape[1]}x{b.shape[0]} vs baseline {a.shape[1]}x{a.shape[0]}",
        }
    x, y = fidelity_arrays(a, b, a_mode, b_mode)
    row: dict[str, Any] = {
        "status": "ok",
        "psnr_db": round(min(psnr(x, y), PSNR_CAP_DB), 3),
        "ssim": round(ssim(x, y), 5),
        "space": "RGBA" if x.shape[2] == 4 else "RGB over white",
    }
    if scorer is not None:
        row["lpips"] = round(scorer(x, y), 5)
    if candidate_data == reference_data:
        row["same_bytes"] = True
    return row


def _has_records(run: Path) -> bool:
    return any(Path(run).glob(RECORDS_FILE)) or any(Path(run).glob("matrix*.json"))


def _settings_mismatch(candidate: ProbeRecord | None, baseline: ProbeRecord) -> str:
    """'steps 4 vs baseline 20, ...' where the candidate's record says it was made differently (what must agree
    for two images to be comparable)."""
    if candidate is None:
        return ""
    settings = (
        ("steps", candidate.steps, baseline.steps),
        ("true_cfg_scale", candidate.true_cfg_scale, baseline.true_cfg_scale),
        ("size", candidate.size, baseline.size),
    )
    return ", ".join(f"{key} {ours} vs baseline {theirs}" for key, ours, theirs in settings if ours != theirs)


def _row(run: Path, baseline: Path, record: ProbeRecord, candidate: ProbeRecord | None, changed: bool,
         scorer: LpipsScorer | None) -> CompareRow:  # fmt: skip
    """The candidate's image of ``record``'s fixture and seed against the baseline's."""
    reference = find_image(baseline, record.fixture_id, record.seed)
    image = find_image(run, record.fixture_id, record.seed)
    mismatch = _settings_mismatch(candidate, record)
    fields: dict[str, Any]
    if reference is None:
        fields = {"status": "error", "error": "baseline image missing"}
    elif image is not None and mismatch:
        fields = {"status": "error", "error": f"made with other settings: {mismatch}"}
    elif image is not None and changed:
        fields = {
            "status": "error",
            "error": "the fixture (prompt, size or references) differs from the baseline's",
        }
    elif image is None:
        fields = {"status": "missing"}
    else:
        fields = _compare_pair(image, reference, scorer, (candidate, record))
    skipped = (candidate.metrics or {}).get("skipped_steps") if candidate is not None else None
    if isinstance(skipped, int):  # its server ran a step cache (--cache)
        fields["skipped_steps"] = skipped
    return CompareRow(
        fixture_id=record.fixture_id,
        seed=record.seed,
        n_references=record.n_references,
        **fields,
    )


def _fixture(
    fixture_id: str,
    rows: list[CompareRow],
    scorer: LpipsScorer | None,
    parity: ParityBand | None,
    lossless: LosslessStandard,
) -> FixtureFidelity:
    """One fixture's rows summarized, and judged against its parity band (None: no band) and the lossless
    standard."""
    ok = [r for r in rows if r.status == "ok"]
    psnr_db = _stats([r.psnr_db for r in ok if r.psnr_db is not None], 2)
    optional: dict[str, Any] = {}  # written only where measured
    if scorer is not None:
        optional["lpips"] = _stats([r.lpips for r in ok if r.lpips is not None], 4)
    if parity is not None and psnr_db.mean is not None:
        by_seed = {r.seed: r.psnr_db for r in ok if r.psnr_db is not None}
        optional.update(
            parity_edge_db=round(parity.edge(fixture_id), 2), parity=parity.decide(fixture_id, by_seed)
        )
    if psnr_db.mean is not None:  # an ok row has both measures
        optional["lossless"] = lossless.decide_rows(ok)
    return FixtureFidelity(
        n=len(rows),
        ok=len(ok),
        missing=sum(r.status == "missing" for r in rows),
        errors=sum(r.status == "error" for r in rows),
        psnr_db=psnr_db,
        ssim=_stats([r.ssim for r in ok if r.ssim is not None], 4),
        **optional,
    )


def _overall(decisions: list[BandDecision], complete: bool) -> tuple[bool, BandDecision]:
    """A run's decision from its fixtures': inside when every one is and every row was compared, outside when any
    is outside, else undecided."""
    inside = bool(decisions) and all(d == "inside" for d in decisions) and complete
    return inside, "inside" if inside else "outside" if "outside" in decisions else "undecided"


def compare_run(
    run: Path,
    baseline: Path,
    *,
    baseline_seal: str = "sealed",
    parity: ParityBand | None = None,
    use_lpips: bool = True,
    lossless: LosslessStandard | None = None,
) -> CompareFile:
    lossless = lossless or LosslessStandard()
    scorer, note = lpips_scorer() if use_lpips else (None, "lpips skipped: not requested")
    candidates = latest_by_key(read_records(run)) if _has_records(run) else {}
    changed = changed_fixtures(run, baseline)
    rows = [
        _row(run, baseline, record, candidates.get(key), record.fixture_id in changed, scorer)
        for key, record in latest_by_key(read_records(baseline)).items()
        if is_success(record)
    ]
    fixtures = {
        fixture_id: _fixture(
            fixture_id, [r for r in rows if r.fixture_id == fixture_id], scorer, parity, lossless
        )
        for fixture_id in dict.fromkeys(r.fixture_id for r in rows)
    }
    ok_rows = [r for r in rows if r.status == "ok"]
    complete = len(ok_rows) == len(rows)
    result_parity = None
    if parity is not None:
        inside, decision = _overall(
            [e.parity.decision for e in fixtures.values() if e.parity is not None], complete
        )
        result_parity = ParityResult(
            source=parity.source,
            overall_db=round(parity.overall_db, 2),
            per_fixture_db={k: round(v, 2) for k, v in parity.per_fixture_db.items()},
            per_seed_db=parity.per_seed_db or None,
            tolerance_db=parity.tolerance_db,
            inside=inside,
            decision=decision,
        )
    lossless_inside, lossless_decision = _overall(
        [e.lossless.decision for e in fixtures.values() if e.lossless is not None], complete
    )
    lossless_result = LosslessResult(
        psnr_db=lossless.psnr_db, ssim=lossless.ssim, inside=lossless_inside, decision=lossless_decision
    )
    return CompareFile(
        run=str(run),
        baseline=str(baseline),
        baseline_seal=baseline_seal,
        lpips_note=note,
        rows=rows,
        fixtures=fixtures,
        overall=FidelityOverall(
            n=len(rows),
            ok=len(ok_rows),
            psnr_db=_stats([r.psnr_db for r in ok_rows if r.psnr_db is not None], 2),
            ssim=_stats([r.ssim for r in ok_rows if r.ssim is not None], 4),
        ),
        parity=result_parity,
        lossless=lossless_result,
    )


def parity_from_pair(first: Path, second: Path, tolerance_db: float) -> ParityBand:
    """The band two acceptable runs span: their PSNR to each other per fixture and seed, its mean per fixture
    and overall. ``first`` is the baseline the candidates are compared with, so that the pair's PSNR at a
    seed and a candidate's are measured against the same image."""
    pair = compare_run(second, first, use_lpips=False)
    overall = pair.overall.psnr_db.mean
    if not pair.overall.ok or overall is None:
        raise InputError(f"--parity-pair: {first} and {second} share no comparable images")
    per_fixture = {k: v.psnr_db.mean for k, v in pair.fixtures.items() if v.ok and v.psnr_db.mean is not None}
    per_seed: dict[str, dict[int, float]] = {}
    for row in pair.rows:
        if row.status == "ok" and row.psnr_db is not None:
            per_seed.setdefault(row.fixture_id, {})[row.seed] = row.psnr_db
    return ParityBand(f"pair {first} vs {second}", overall, per_fixture, tolerance_db, per_seed)


def seeds_to_add(
    decision: ParityDecision | LosslessDecision | None, have: Sequence[int], cap: int
) -> list[int]:
    """The seeds an undecided fixture should get next, as ``ditq sweep --seeds auto`` and ``ditq plan`` add
    them: as many as its decision says would settle it (at least one more, at most ``cap`` in all), numbered on
    from its highest seed; none when it is decided, already at the cap, or has no decision."""
    if decision is None or decision.decision != "undecided" or len(have) >= cap:
        return []
    target = min(cap, max(decision.seeds_to_settle or cap, len(have) + 1))
    return list(range(max(have) + 1, max(have) + 1 + target - len(have)))


def settle_seeds(
    more_seeds: Callable[[], dict[str, list[int]]], run_more: Callable[[dict[str, list[int]]], None]
) -> None:
    """The seed-settling loop that ``ditq sweep --seeds auto`` and ``ditq plan`` share: ask which fixtures need which
    more seeds (each caller's judgment, through ``seeds_to_add``), run them everywhere a fixture's PSNR is paired,
    and ask again, until no fixture needs any (``seeds_to_add`` stops at the cap, so the loop ends)."""
    while more := {fixture: seeds for fixture, seeds in more_seeds().items() if seeds}:
        run_more(more)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def describe_parity(decision: ParityDecision) -> str:
    """'inside the band: -0.42 dB [-0.81, -0.10] vs the pair over 4 seeds (floor -1 dB)', and for an undecided
    fixture about how many seeds would settle it."""
    reference = "the pair" if decision.reference == "pair" else "the stated band"
    if decision.difference_db is None:
        return f"undecided: {decision.n} image(s) cannot show a spread (floor {decision.floor_db:g} dB)"
    text = (
        f"{decision.decision}: {decision.difference_db:+.2f} dB [{decision.low_db:+.2f}, {decision.high_db:+.2f}] "
        f"vs {reference} over {decision.n} seeds (floor {decision.floor_db:+g} dB)"
    )
    if decision.decision == "undecided":
        settle = decision.seeds_to_settle
        text += f"; about {settle} seeds would settle it" if settle else "; more seeds would not settle it"
    return text


def describe_lossless(decision: LosslessDecision) -> str:
    """'inside: PSNR 43.10 dB [42.80, 43.40] (at least 40 dB), SSIM 0.9961 [0.9950, 0.9972] (at least 0.98) over 4
    seeds', and for an undecided fixture about how many seeds would settle it."""
    if decision.n < 2:
        return f"undecided: {decision.n} image(s) cannot show a spread (at least 2 seeds needed)"
    parts = []
    for name, measure, unit, spec in (
        ("PSNR", decision.psnr_db, " dB", ".2f"),
        ("SSIM", decision.ssim, "", ".4f"),
    ):
        interval = (
            f" [{measure.low:{spec}}, {measure.high:{spec}}]"
            if measure.low is not None and measure.high is not None
            else ""
        )
        parts.append(
            f"{name} {_fmt(measure.estimate, spec)}{unit}{interval} (at least {measure.threshold:g}{unit})"
        )
    text = f"{decision.decision}: {', '.join(parts)} over {decision.n} seed{'' if decision.n == 1 else 's'}"
    if decision.decision == "undecided":
        settle = decision.seeds_to_settle
        text += f"; about {settle} seeds would settle it" if settle else "; more seeds would not settle it"
    return text


def identical_images(result: CompareFile) -> int:
    """How many of the compared images are the baseline's, byte for byte."""
    return sum(1 for row in result.rows if row.same_bytes)


def same_bytes_note(same: int, compared: int) -> str:
    return (
        f"{same} of {compared} compared images are the baseline's, byte for byte: a quantized model does not draw "
        "that, so the run may hold the baseline's own images"
    )


def format_compare(results: Sequence[CompareFile]) -> str:
    lines = []
    for res in results:
        lines.append(f"== {res.run} vs {res.baseline} (baseline {res.baseline_seal}) ==")
        for row in res.rows:
            head = f"    {row.fixture_id} s{row.seed}: "
            if row.status == "ok":
                extra = f" lpips {row.lpips:.4f}" if row.lpips is not None else ""
                lines.append(
                    head
                    + f"PSNR {_fmt(row.psnr_db, '.2f')} dB  SSIM {_fmt(row.ssim, '.4f')}{extra}  ({row.space})"
                )
            else:
                lines.append(head + row.status.upper() + (f": {row.error}" if row.error else ""))
        for fixture_id, e in res.fixtures.items():
            p, s = e.psnr_db, e.ssim
            band = "" if e.parity is None else "  " + describe_parity(e.parity)
            band += "" if e.lossless is None else "  lossless " + describe_lossless(e.lossless)
            lines.append(
                f"  {fixture_id}: n={e.n} ok={e.ok} missing={e.missing} errors={e.errors}  "
                f"PSNR mean {_fmt(p.mean, '.2f')} [{_fmt(p.min, '.2f')}, {_fmt(p.max, '.2f')}] dB  "
                f"SSIM mean {_fmt(s.mean, '.4f')}{band}"
            )
        lines.append(f"  {res.lpips_note}")
        if same := identical_images(res):
            lines.append(f"  note: {same_bytes_note(same, res.overall.ok)}")
        overall = res.overall
        lines.append(
            f"  overall: {overall.ok}/{overall.n} compared, PSNR mean {_fmt(overall.psnr_db.mean, '.2f')} dB"
        )
        if res.parity is not None:
            decision = res.parity.decision or ("inside" if res.parity.inside else "outside")
            lines.append(
                f"  parity band ({res.parity.source}, {res.parity.overall_db:.2f} dB, tolerance "
                f"{res.parity.tolerance_db:g} dB): {decision.upper()}"
            )
        if res.lossless is not None:
            lines.append(
                f"  visually lossless (PSNR at least {res.lossless.psnr_db:g} dB, SSIM at least "
                f"{res.lossless.ssim:g}): {res.lossless.decision.upper()}"
            )
    return "\n".join(lines)
