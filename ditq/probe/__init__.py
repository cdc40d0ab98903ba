"""Probing a server: fixtures, the fixtures x seeds runner, run records and the memory sampler."""

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
