"""From gathered runs to judged candidates and the verdict document (no files written here)."""

from __future__ import annotations

import datetime
import platform
import sys
from dataclasses import dataclass

import ditq
from ditq.report.capacity import CapacityRow, capacity_matrix, max_references_served
from ditq.report.model import Candidate
from ditq.report.provenance import device_description, git_revision, library_versions
from ditq.report.schema import (
    BaselineEntry,
    CandidateVerdict,
    Provenance,
    ReasonEntry,
    ReferenceProfile,
    ServingProfile,
    VerdictDocument,
)
from ditq.report.verdict import Reason, VerdictRules, decide, parity_floor_db

__all__ = ["Assessment", "ReportData", "assess", "serving_profile"]


@dataclass
class Assessment:
    candidate: Candidate
    matrix: list[CapacityRow]
    reasons: list[Reason]
    floor_db: float | None
    profile: ServingProfile

    @property
    def verdict(self) -> str:
        return "NO" if self.reasons else "YES"


@dataclass
class ReportData:
    baseline: Candidate
    baseline_matrix: list[CapacityRow]
    baseline_profile: ServingProfile
    assessments: list[Assessment]
    document: VerdictDocument
    rules: VerdictRules

    @property
    def all_candidates(self) -> list[Candidate]:
        return [self.baseline, *(a.candidate for a in self.assessments)]

    @property
    def reference_counts(self) -> list[int]:
        rows = [*self.baseline_matrix, *(row for a in self.assessments for row in a.matrix)]
        return sorted({row.n_references for row in rows})


def serving_profile(candidate: Candidate, matrix: list[CapacityRow]) -> ServingProfile:
    return ServingProfile(
        scheme=candidate.scheme,
        artifact_digest=candidate.artifact_digest,
        max_references_served=max_references_served(candidate),
        seconds_per_image={
            str(row.n_references): round(row.wall_mean_s, 3) for row in matrix if row.wall_mean_s is not None
        },
        peak_memory_bytes=candidate.run.peak_memory_bytes if candidate.run else None,
        memory_budget=candidate.memory_budget,
        endpoint=candidate.endpoint,
        by_references=[
            ReferenceProfile(
                references=row.n_references,
                requests=row.requests,
                served=row.served,
                out_of_memory=row.out_of_memory,
                seconds_per_image=row.wall_mean_s,
                seconds_min=row.wall_min_s,
                seconds_max=row.wall_max_s,
                peak_memory_bytes=row.peak_memory_bytes,
                gate_passed=row.gate_passed,
                psnr_mean_db=row.psnr_mean_db,
                ssim_mean=row.ssim_mean,
            )
            for row in matrix
        ],
    )


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
    baseline: Candidate, candidates: list[Candidate], report_command: str, rules: VerdictRules | None = None
) -> ReportData:
    rules = rules or VerdictRules()
    if baseline.run is None:
        raise ValueError("the baseline has no run")
    baseline_matrix = capacity_matrix(baseline.run)
    assessments = []
    for candidate in candidates:
        matrix = capacity_matrix(candidate.run) if candidate.run else []
        assessments.append(
            Assessment(
                candidate=candidate,
                matrix=matrix,
                reasons=decide(candidate, baseline, rules),
                floor_db=parity_floor_db(candidate, rules),
                profile=serving_profile(candidate, matrix),
            )
        )
    budgets = {c.memory_budget for c in [baseline, *candidates] if c.memory_budget}
    baseline_profile = serving_profile(baseline, baseline_matrix)
    document = VerdictDocument(
        schema_version="ditq-verdict-1",
        generated_utc=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        memory_budget=", ".join(sorted(budgets)) if budgets else None,
        baseline=BaselineEntry(name=baseline.name, run=str(baseline.run.path), profile=baseline_profile),
        candidates=[
            CandidateVerdict(
                name=a.candidate.name,
                verdict="NO" if a.reasons else "YES",
                reasons=[ReasonEntry(code=r.code, message=r.message) for r in a.reasons],  # type: ignore[arg-type]
                profile=a.profile,
                run=str(a.candidate.run.path) if a.candidate.run else None,
                parity_floor_db=a.floor_db,
            )
            for a in assessments
        ],
        provenance=_provenance(baseline, candidates, report_command),
    )
    return ReportData(baseline, baseline_matrix, baseline_profile, assessments, document, rules)
