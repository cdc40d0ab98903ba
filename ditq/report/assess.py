"""From gathered runs to judged candidates and the verdict document (no files written here)."""

from __future__ import annotations

import datetime
import platform
import sys

import ditq
from ditq.report.assessment import Assessment, ReportData
from ditq.report.capacity import CapacityRow, capacity_matrix, max_references_served
from ditq.report.ladder import server_starts
from ditq.report.model import Candidate
from ditq.report.objectives import fit_by_standard, objectives
from ditq.report.provenance import device_description, git_revision, library_versions
from ditq.report.recommend import recommend
from ditq.report.schema import (
    OBJECTIVES,
    BaselineEntry,
    CandidateVerdict,
    Provenance,
    ReferenceProfile,
    ServingProfile,
    VerdictDocument,
)
from ditq.report.verdict import STANDARD_RULES, VerdictRules, parity_floor_db

__all__ = ["Assessment", "ReportData", "assess", "serving_profile", "source_weight_bytes"]


def _reference_profile(row: CapacityRow) -> ReferenceProfile:
    return ReferenceProfile(
        references=row.n_references,
        requests=row.requests,
        served=row.served,
        out_of_memory=row.out_of_memory,
        offload=",".join(row.offload) or None,
        parallel=",".join(row.parallel) or None,
        seconds_per_image=row.wall_mean_s,
        seconds_median=row.wall_median_s,
        seconds_min=row.wall_min_s,
        seconds_max=row.wall_max_s,
        seconds_first=row.wall_first_s,
        peak_memory_bytes=row.peak_memory_bytes,
        gate_passed=row.gate_passed,
        psnr_mean_db=row.psnr_mean_db,
        ssim_mean=row.ssim_mean,
    )


def serving_profile(
    candidate: Candidate, matrix: list[CapacityRow], weight_bytes: int | None = None
) -> ServingProfile:
    """``weight_bytes``: the quantized components' bytes; None: the candidate's own (CANDIDATE.json)."""
    if weight_bytes is None and candidate.weight_bytes:
        weight_bytes = sum(w.artifact for w in candidate.weight_bytes.values())
    loaded = next((s.health for s in server_starts(candidate) if s.health and s.health.load_seconds), None)
    return ServingProfile(
        scheme=candidate.scheme,
        artifact_digest=candidate.artifact_digest,
        max_references_served=max_references_served(candidate),
        seconds_per_image={
            str(row.n_references): round(row.wall_mean_s, 3) for row in matrix if row.wall_mean_s is not None
        },
        peak_memory_bytes=candidate.run.peak_memory_bytes if candidate.run else None,
        memory_budget=candidate.memory_budget,
        load_seconds=loaded.load_seconds if loaded else None,
        kernel_paths=dict(loaded.kernel_paths) if loaded else {},
        weight_bytes=weight_bytes,
        endpoint=candidate.endpoint,
        by_references=[_reference_profile(row) for row in matrix],
    )


def source_weight_bytes(candidates: list[Candidate]) -> int | None:
    """The source model's bytes of the components the candidates quantized (the first that says)."""
    sized = next((c.weight_bytes for c in candidates if c.weight_bytes), None)
    return sum(w.source for w in sized.values()) if sized else None


def _provenance(baseline: Candidate, candidates: list[Candidate], report_command: str) -> Provenance:
    return Provenance(
        ditq_version=ditq.__version__,
        git_revision=git_revision(),
        libraries=library_versions(),
        device=device_description(),
        python=sys.version.split()[0],
        platform=platform.platform(),
        report_command=report_command,
        run_commands={c.name: c.commands for c in [baseline, *candidates]},
    )


def assess(
    baseline: Candidate,
    candidates: list[Candidate],
    report_command: str,
    rules: VerdictRules | None = None,
    note: str | None = None,
) -> ReportData:
    rules = rules or VerdictRules()
    if baseline.run is None:
        raise ValueError("the baseline has no run")
    baseline_matrix = capacity_matrix(baseline.run)
    baseline_profile = serving_profile(baseline, baseline_matrix, source_weight_bytes(candidates))
    objective = OBJECTIVES[rules.objective]
    assessments = []
    for candidate in candidates:
        matrix = capacity_matrix(candidate.run) if candidate.run else []
        fits = fit_by_standard(candidate, baseline, rules)
        reasons = fits[rules.standard][0]
        profile = serving_profile(candidate, matrix)
        assessments.append(
            Assessment(
                candidate=candidate,
                matrix=matrix,
                reasons=reasons,
                floor_db=parity_floor_db(candidate, rules),
                profile=profile,
                objectives=objectives(candidate, baseline, fits, profile, baseline_profile, rules),
                objective=objective,
            )
        )
    budgets = {c.memory_budget for c in [baseline, *candidates] if c.memory_budget}
    document = VerdictDocument(
        schema_version="ditq-verdict-3",
        generated_utc=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        objective=objective,
        standard=rules.standard,
        standards=STANDARD_RULES,
        recommendation=recommend(assessments, baseline_profile, rules, baseline.name),
        note=note,
        memory_budget=", ".join(sorted(budgets)) if budgets else None,
        baseline=BaselineEntry(name=baseline.name, run=str(baseline.run.path), profile=baseline_profile),
        candidates=[
            CandidateVerdict(
                name=a.candidate.name,
                verdict=a.verdict,
                reasons=a.headline.reasons,
                objectives=a.objectives,
                profile=a.profile,
                run=str(a.candidate.run.path) if a.candidate.run else None,
                parity_floor_db=a.floor_db,
            )
            for a in assessments
        ],
        provenance=_provenance(baseline, candidates, report_command),
    )
    return ReportData(baseline, baseline_matrix, baseline_profile, assessments, document, rules)
