"""Probing a server: fixtures, the fixtures x seeds runner, run records and the memory sampler."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ditq.lazy import lazy_names

# Public name -> module that defines it, imported on first use: importing one light submodule (a command's
# --help reads its choices) does not import its heavy siblings.
_LAZY: dict[str, str] = {
    "Fixture": "ditq.probe.fixtures",
    "MemorySampler": "ditq.probe.memory",
    "ProbeOptions": "ditq.probe.runner",
    "ProbeSummary": "ditq.probe.runner",
    "RecordLog": "ditq.probe.records",
    "find_image": "ditq.probe.records",
    "fixture_digest": "ditq.probe.fixtures",
    "is_success": "ditq.probe.records",
    "latest_by_key": "ditq.probe.records",
    "load_fixtures": "ditq.probe.fixtures",
    "parse_seeds": "ditq.probe.fixtures",
    "read_records": "ditq.probe.records",
    "read_vram_csv": "ditq.probe.memory",
    "run_matrix": "ditq.probe.runner",
    "run_probe": "ditq.probe.runner",
}

if TYPE_CHECKING:  # the names as their modules define them, for the type checker
    from ditq.probe.fixtures import Fixture, fixture_digest, load_fixtures, parse_seeds
    from ditq.probe.memory import MemorySampler, read_vram_csv
    from ditq.probe.records import RecordLog, find_image, is_success, latest_by_key, read_records
    from ditq.probe.runner import ProbeOptions, ProbeSummary, run_matrix, run_probe

__all__ = [
    "Fixture",
    "MemorySampler",
    "ProbeOptions",
    "ProbeSummary",
    "RecordLog",
    "find_image",
    "fixture_digest",
    "is_success",
    "latest_by_key",
    "load_fixtures",
    "parse_seeds",
    "read_records",
    "read_vram_csv",
    "run_matrix",
    "run_probe",
]


__getattr__ = lazy_names(__name__, _LAZY)
