"""The report: capacity matrices, verdicts with reasons, serving profiles, grids, charts, provenance."""

from __future__ import annotations

from ditq.report.build import ReportResult, build_report
from ditq.report.model import Candidate, RunData, load_candidate, load_run
from ditq.report.schema import (
    SCHEMA_PATH,
    VerdictDocument,
    json_schema,
    validate_verdict,
    validate_verdict_file,
)
from ditq.report.verdict import Reason, VerdictRules, decide

__all__ = [
    "SCHEMA_PATH",
    "Candidate",
    "Reason",
    "ReportResult",
    "RunData",
    "VerdictDocument",
    "VerdictRules",
    "build_report",
    "decide",
    "json_schema",
    "load_candidate",
    "load_run",
    "validate_verdict",
    "validate_verdict_file",
]
