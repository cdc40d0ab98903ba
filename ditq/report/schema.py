"""verdict.json: the typed shape another system reads to pick a serving profile without reading prose.

The pydantic models below are the schema (``extra="forbid"`` everywhere); ``verdict.schema.json``
next to this file is their JSON Schema, shipped for consumers in other languages, and kept equal
to the models by a test.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ditq.errors import InputError
from ditq.runfiles import parse

__all__ = [
    "SCHEMA_PATH",
    "SCHEMA_VERSION",
    "BaselineEntry",
    "CandidateVerdict",
    "Provenance",
    "ReasonEntry",
    "ReferenceProfile",
    "ServingProfile",
    "VerdictDocument",
    "json_schema",
    "validate_verdict",
    "validate_verdict_file",
]

SCHEMA_VERSION = "ditq-verdict-1"
SCHEMA_PATH = Path(__file__).with_name("verdict.schema.json")

ReasonCode = Literal[
    "stage_failure",
    "doctor_failure",
    "failed_requests",
    "out_of_memory",
    "collapsed_outputs",
    "baseline_collapsed",
    "no_gate_result",
    "outside_parity_band",
    "no_fidelity_result",
    "slower_than_baseline",
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="null")


class ReasonEntry(_Strict):
    code: ReasonCode
    message: str = Field(min_length=1, description="one sentence")


class ReferenceProfile(_Strict):
    references: int = Field(ge=0, description="number of reference images per request")
    requests: int = Field(ge=0)
    served: int = Field(ge=0, description="requests answered with an image")
    out_of_memory: int = Field(ge=0)
    offload: str | None = Field(
        description="offload mode(s) its served requests were served at, comma-joined; null: not known"
    )
    seconds_per_image: float | None = Field(
        description="mean wall time of warm served requests: a server's first request of each shape (reference "
        "count, size) is cold and left out, unless the shape had no other request"
    )
    seconds_median: float | None = Field(description="median wall time over the same requests")
    seconds_min: float | None
    seconds_max: float | None
    seconds_first: float | None = Field(
        description="mean wall time of the cold requests (each server start's first request of a shape)"
    )
    peak_memory_bytes: int | None = Field(description="largest per-request peak the server reported")
    gate_passed: int | None
    psnr_mean_db: float | None = Field(description="null when nothing was compared or images were identical")
    ssim_mean: float | None


class ServingProfile(_Strict):
    scheme: str | None = Field(description="w8a16 | w8a8 | fp8, or null for the BF16 baseline")
    artifact_digest: str | None = Field(description="sha256 of the artifact's MANIFEST.json")
    max_references_served: int = Field(ge=0, description="largest reference count with every request served")
    seconds_per_image: dict[str, float] = Field(
        description="reference count -> mean seconds per image over warm requests"
    )
    peak_memory_bytes: int | None = Field(
        description="run peak: sampled memory (the server process's where the driver shows it, else its "
        "device's), else server-reported"
    )
    memory_budget: str | None = Field(description="--max-memory the server ran under; null: the whole device")
    load_seconds: float | None = Field(
        description="seconds the first server that loaded the model took to load it (its /health); null: unknown"
    )
    kernel_paths: dict[str, int] = Field(
        description="kernel path -> quantized layers using it, as that server reported; empty: none or unknown"
    )
    weight_bytes: int | None = Field(
        description="bytes of the quantized components' weight files (for the baseline: the same components "
        "in the source model); null: unknown"
    )
    endpoint: str | None
    by_references: list[ReferenceProfile]


class CandidateVerdict(_Strict):
    name: str
    verdict: Literal["YES", "NO"]
    reasons: list[ReasonEntry]
    profile: ServingProfile
    run: str | None = Field(description="the run directory the numbers come from")
    parity_floor_db: float | None


class BaselineEntry(_Strict):
    name: str
    run: str
    profile: ServingProfile


class Provenance(_Strict):
    ditq_version: str
    git_revision: str | None
    libraries: dict[str, str]
    device: str
    python: str
    platform: str
    report_command: str
    run_commands: dict[str, list[str]] = Field(
        description="candidate name -> the commands behind its numbers"
    )


class VerdictDocument(_Strict):
    schema_version: Literal["ditq-verdict-1"]
    generated_utc: str
    note: str | None = Field(
        description="what the reader must know first, e.g. that the weights are random, so PSNR and SSIM measure "
        "numerical deviation, not image quality"
    )
    memory_budget: str | None
    baseline: BaselineEntry
    candidates: list[CandidateVerdict]
    provenance: Provenance


def json_schema() -> dict[str, Any]:
    schema = VerdictDocument.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = SCHEMA_VERSION
    return schema


def validate_verdict(document: Any, where: str = "verdict.json") -> VerdictDocument:
    """Parse and check a verdict document; raise InputError naming the first bad field."""
    return parse(VerdictDocument, document, where)


def validate_verdict_file(path: Path) -> VerdictDocument:
    path = Path(path)
    try:
        document = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise InputError(f"{path}: not valid JSON ({error.msg})") from None
    return validate_verdict(document, str(path))
