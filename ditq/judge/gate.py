"""The structure gate: is every image of a run intact, and does it sit where the baseline sits?

Two kinds of rule, both data (``gate_rules.json``, or ``--rules FILE``):

1. *Signatures* are absolute: a record fails when every ``when`` condition holds,
   unless every ``unless`` condition can be evaluated and holds (e.g. a clean
   cut-out is not a collapse). A signature whose metrics a record lacks is listed
   as unchecked, not failed.
2. *Envelope*, with a baseline run: per fixture, each listed metric must lie in
   ``[min - h, max + h]`` of the baseline's own values, ``h = max(k * std,
   margin, relative_margin * |mean|)``, so ordinary seed-to-seed variation passes
   and a drift far outside it fails.

With a baseline, a signature that the baseline's own image of the same fixture and
seed shows too is *inherited*: listed apart (``inherited``), not a failure of the
run, since the unquantized model made the same picture (a model with random
weights, say). The report says so instead of calling it a collapse.

Structure is recomputed from the image when the run has it, else taken from the
record (the seed probe's evidence keeps records but not images).
"""

from __future__ import annotations

import hashlib
import logging
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ditq.metrics import structure_metrics_png
from ditq.pictures import read_picture_bytes
from ditq.probe.memory import peak_mib, read_vram_csv
from ditq.probe.records import (
    changed_fixtures,
    find_image,
    is_success,
    latest_by_key,
    read_records,
    require_complete,
)
from ditq.runfiles import (
    RECORDS_FILE,
    RUN_FILE,
    GateFile,
    GateRecord,
    GateSummary,
    ProbeRecord,
    Structure,
    StructureSource,
)
from ditq.signatures import GateRules, load_rules

__all__ = [
    "Envelope",
    "GateRules",
    "GateRun",
    "baseline_signatures",
    "build_envelopes",
    "format_gate",
    "gate_run",
    "load_rules",
    "record_structure",
]

log = logging.getLogger(__name__)


def record_structure(run: Path, record: ProbeRecord) -> tuple[Structure | None, StructureSource]:
    """(structure, where it came from): recomputed from the image if present, else as recorded."""
    image = find_image(run, record.fixture_id, record.seed)
    if image is not None:
        try:
            data = read_picture_bytes(image)
            structure = Structure.model_validate(structure_metrics_png(data))
        except Exception as error:  # judged as a failure below: no structure
            log.warning("%s cannot be decoded (%s: %s)", image, type(error).__name__, error)
            return None, "undecodable image"
        if record.sha256 and hashlib.sha256(data).hexdigest() != record.sha256:  # swapped or edited since
            log.warning("%s is not the image its record names (sha256 differs)", image)
            return None, "image not the recorded one"
        return structure, "image"
    recorded = record.structure
    if recorded is None:
        return None, "none"
    stds = recorded.rgb_std
    if recorded.rgb_std_mean is None and stds:  # the seed recorded the channels only
        recorded = recorded.model_copy(update={"rgb_std_mean": round(sum(stds) / len(stds), 2)})
    return recorded, "recorded"


@dataclass(frozen=True)
class Envelope:
    fixture_id: str
    n: int
    bands: dict[str, tuple[float, float]]  # metric -> (low, high)


def build_envelopes(baseline: Path, rules: GateRules) -> dict[str, Envelope]:
    """Per fixture, the band of each envelope metric from the baseline's own successful records."""
    values: dict[str, dict[str, list[float]]] = {}
    for record in latest_by_key(read_records(baseline)).values():
        if not is_success(record):
            continue
        structure, _ = record_structure(baseline, record)
        if structure is None:
            continue
        measured = structure.as_metrics()
        per_metric = values.setdefault(record.fixture_id, {})
        for m in rules.envelope:
            if measured.get(m.metric) is not None:
                per_metric.setdefault(m.metric, []).append(float(measured[m.metric]))
    envelopes = {}
    for fixture_id, per_metric in values.items():
        bands = {}
        for m in rules.envelope:
            xs = per_metric.get(m.metric)
            if not xs:
                continue
            spread = statistics.pstdev(xs) if len(xs) > 1 else 0.0
            half = max(m.k * spread, m.margin, m.relative_margin * abs(statistics.fmean(xs)))
            bands[m.metric] = (min(xs) - half, max(xs) + half)
        envelopes[fixture_id] = Envelope(
            fixture_id, max((len(v) for v in per_metric.values()), default=0), bands
        )
    return envelopes


@dataclass
class GateRun:
    run: str
    format: Literal["ditq", "seed-matrix"]
    baseline: str | None
    rules: str
    records: list[GateRecord] = field(default_factory=list)
    run_peak_memory_mib: float | None = None
    run_peak_source: str = "unavailable"

    @property
    def passed(self) -> bool:
        return bool(self.records) and all(r.passed for r in self.records)

    def summary(self) -> dict[int, GateSummary]:
        rows: dict[int, GateSummary] = {}
        for n_refs in sorted({r.n_references for r in self.records}):
            group = [r for r in self.records if r.n_references == n_refs]
            walls = [r.wall_s for r in group]
            peaks = [r.peak_memory_mib for r in group if r.peak_memory_mib is not None]
            rows[n_refs] = GateSummary(
                n=len(group),
                passes=sum(r.passed for r in group),
                wall_min_s=min(walls, default=None),
                wall_max_s=max(walls, default=None),
                wall_mean_s=round(statistics.fmean(walls), 2) if walls else None,
                peak_memory_mib=max(peaks, default=None),
                peak_memory_source="/".join(
                    sorted({r.peak_memory_source for r in group if r.peak_memory_source})
                ),
            )
        return rows

    def to_file(self) -> GateFile:
        return GateFile(
            run=self.run,
            format=self.format,
            baseline=self.baseline,
            rules=self.rules,
            verdict="PASS" if self.passed else "FAIL",
            passes=sum(r.passed for r in self.records),
            n=len(self.records),
            run_peak_memory_mib=self.run_peak_memory_mib,
            run_peak_source=self.run_peak_source,
            by_references=self.summary(),
            records=self.records,
        )


def _record_peak(record: ProbeRecord) -> tuple[float | None, Literal["sampled", "server"] | None]:
    """(peak, source): sampled on the device during the request, else the server's own report."""
    if record.peak_memory_mib is not None:
        return record.peak_memory_mib, "sampled"
    server = record.server_peak_mib
    return (server, "server") if server is not None else (None, None)


def baseline_signatures(baseline: Path, rules: GateRules) -> dict[tuple[str, int], set[str]]:
    """(fixture_id, seed) -> the signatures the baseline's own image fires."""
    fired: dict[tuple[str, int], set[str]] = {}
    for key, record in latest_by_key(read_records(baseline)).items():
        structure, _ = record_structure(baseline, record) if is_success(record) else (None, "none")
        if structure is not None:
            measured = structure.as_metrics()
            fired[key] = {sig.name for sig in rules.signatures if sig.fires(measured)}
    return fired


def _judge(
    structure: dict[str, Any], rules: GateRules, envelope: Envelope | None, in_baseline: set[str]
) -> tuple[list[str], list[str], list[str]]:
    """(failures, unchecked, inherited): ``in_baseline`` are the signatures the baseline's image shows."""
    reasons: list[str] = []
    unchecked: list[str] = []
    inherited: list[str] = []
    for sig in rules.signatures:
        fired = sig.fires(structure)
        if fired is None:
            missing = [c.metric for c in sig.when if c.holds(structure) is None]
            unchecked.append(f"{sig.name} (no {', '.join(missing)})")
        elif fired:
            (inherited if sig.name in in_baseline else reasons).append(sig.describe(structure))
    if envelope is not None:
        for metric, (low, high) in envelope.bands.items():
            value = structure.get(metric)
            if value is None:
                unchecked.append(f"envelope {metric} (not measured)")
            elif not low <= float(value) <= high:
                reasons.append(
                    f"drift: {metric} {value} outside the baseline envelope [{low:.4g}, {high:.4g}] (n={envelope.n})"
                )
    return reasons, unchecked, inherited


def gate_run(
    run: Path,
    rules: GateRules,
    envelopes: dict[str, Envelope] | None = None,
    baseline: str | None = None,
    baseline_dir: Path | None = None,
) -> GateRun:
    """Judge every record of ``run``; with ``envelopes`` (from ``baseline_dir``) the envelope too, and with
    ``baseline_dir`` the signatures its images show are inherited rather than failures. A run that is not
    complete (its RUN.json says otherwise, or a planned request has no record) is refused: an InputError."""
    run = Path(run)
    require_complete(run)
    changed = changed_fixtures(run, baseline_dir) if baseline_dir is not None else set()
    in_baseline = baseline_signatures(baseline_dir, rules) if baseline_dir is not None else {}
    records = latest_by_key(read_records(run))
    result = GateRun(
        run=str(run),
        format="ditq" if (run / RUN_FILE).exists() or (run / RECORDS_FILE).exists() else "seed-matrix",
        baseline=baseline,
        rules=rules.source,
    )
    for record in records.values():
        structure, source = record_structure(run, record)
        reasons: list[str]
        unchecked: list[str] = []
        inherited: list[str] = []
        if not is_success(record) and record.error:
            reasons = [f"request failed: {record.error[:200]}"]
        elif structure is None:
            reasons = [
                {
                    "undecodable image": "image cannot be decoded",
                    "image not the recorded one": "image is not the one its record names (sha256 differs)",
                }.get(source, "no image and no recorded structure")
            ]
        else:
            envelope = None if envelopes is None else envelopes.get(record.fixture_id)
            reasons, unchecked, inherited = _judge(
                structure.as_metrics(), rules, envelope, in_baseline.get(record.key, set())
            )
            if record.fixture_id in changed:
                reasons.append("the fixture (prompt, size or references) differs from the baseline's")
            if envelopes is not None and envelope is None:
                unchecked.append("envelope (fixture not in the baseline)")
        peak, peak_source = _record_peak(record)
        result.records.append(
            GateRecord(
                fixture_id=record.fixture_id,
                seed=record.seed,
                n_references=record.n_references,
                passed=not reasons,
                reasons=reasons,
                unchecked=unchecked,
                inherited=inherited,
                structure=structure,
                structure_source=source,
                wall_s=record.wall_s,
                peak_memory_mib=peak,
                peak_memory_source=peak_source,
            )
        )
    sampled = read_vram_csv(run / "vram.csv")
    if sampled:
        result.run_peak_memory_mib, result.run_peak_source = peak_mib(sampled), "vram.csv"
    else:
        peaks = [r.peak_memory_mib for r in result.records if r.peak_memory_mib is not None]
        if peaks:
            result.run_peak_memory_mib, result.run_peak_source = (
                max(peaks),
                "records: server-reported peak_memory_mb",
            )
    return result


def _num(value: float | None, fmt: str = ".1f") -> str:
    return "-" if value is None else format(value, fmt)


def format_gate(results: Sequence[GateRun]) -> str:
    lines = []
    for run in results:
        lines.append(
            f"== {run.run} ({run.format}, {len(run.records)} records, rules {run.rules}"
            + (f", baseline {run.baseline}" if run.baseline else ", no baseline")
            + ") =="
        )
        for n_refs, row in run.summary().items():
            lines.append(
                f"  {n_refs}-ref: n={row.n} pass={row.passes}/{row.n} "
                f"{'PASS' if row.passes == row.n else 'FAIL'}  wall {_num(row.wall_min_s)}-"
                f"{_num(row.wall_max_s)} s (mean {_num(row.wall_mean_s)} s)  "
                f"peak {_num(row.peak_memory_mib, '.0f')} MiB ({row.peak_memory_source or 'unavailable'})"
            )
            for rec in (r for r in run.records if r.n_references == n_refs):
                detail = "; ".join(rec.reasons) if rec.reasons else "ok"
                lines.append(
                    f"    {rec.fixture_id} s{rec.seed}: {'PASS' if rec.passed else 'FAIL'} "
                    f"[{rec.structure_source}] {detail}"
                )
        inherited = sorted({name for r in run.records for name in r.inherited_rules})
        if inherited:
            lines.append(
                f"  inherited from the baseline (its own images show them; not counted): {', '.join(inherited)}"
            )
        unchecked = sorted({u for r in run.records for u in r.unchecked})
        if unchecked:
            lines.append(f"  unchecked: {'; '.join(unchecked)}")
        lines.append(f"  peak memory: {_num(run.run_peak_memory_mib, '.0f')} MiB ({run.run_peak_source})")
        passes = sum(r.passed for r in run.records)
        lines.append(f"  GATE: {'PASS' if run.passed else 'FAIL'} ({passes}/{len(run.records)} pass)")
    return "\n".join(lines)
