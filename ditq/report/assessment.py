"""A judged candidate (``Assessment``) and everything a report is drawn from (``ReportData``): the values that
``assess`` makes and the ranking, the tables and the pages read, in a module of their own so that the ranking
(``recommend``) and the assessing (``assess``) that calls it import them without importing each other."""

from __future__ import annotations

from dataclasses import dataclass

from ditq.report.capacity import CapacityRow
from ditq.report.model import Candidate
from ditq.report.schema import Answer, ObjectiveAnswer, Objectives, ServingProfile, VerdictDocument
from ditq.report.verdict import Reason, VerdictRules

__all__ = ["Assessment", "ReportData"]


@dataclass
class Assessment:
    candidate: Candidate
    matrix: list[CapacityRow]
    reasons: list[Reason]  # fit to serve's
    floor_db: float | None
    profile: ServingProfile
    objectives: Objectives
    objective: str  # the headline's: fit_to_serve | faster | smaller

    @property
    def headline(self) -> ObjectiveAnswer:
        answer: ObjectiveAnswer = getattr(self.objectives, self.objective)
        return answer

    @property
    def verdict(self) -> Answer:
        return self.headline.answer


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
