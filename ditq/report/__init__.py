"""The report: capacity matrices, verdicts with reasons, serving profiles, grids, charts, provenance."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ditq.lazy import lazy_names

# Public name -> module that defines it, imported on first use: importing one light submodule (a command's
# --help reads its choices) does not import its heavy siblings.
_LAZY: dict[str, str] = {
    "Candidate": "ditq.report.model",
    "Reason": "ditq.report.verdict",
    "ReportResult": "ditq.report.build",
    "RunData": "ditq.report.model",
    "SCHEMA_PATH": "ditq.report.schema",
    "VerdictDocument": "ditq.report.schema",
    "VerdictRules": "ditq.report.verdict",
    "build_report": "ditq.report.build",
    "decide": "ditq.report.verdict",
    "json_schema": "ditq.report.schema",
    "load_candidate": "ditq.report.model",
    "load_run": "ditq.report.model",
    "validate_verdict": "ditq.report.schema",
    "validate_verdict_file": "ditq.report.schema",
}

if TYPE_CHECKING:  # the names as their modules define them, for the type checker
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


__getattr__ = lazy_names(__name__, _LAZY)
