"""verdict.json: the typed shape another system reads to pick a serving profile without reading prose.

The pydantic models below are the schema (``extra="forbid"`` everywhere); ``verdict.schema.json``
next to this file is their JSON Schema, shipped for consumers in other languages, and kept equal
to the models by a test.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ditq.errors import InputError
from ditq.jsonfile import read_json
from ditq.runfiles import parse

__all__ = [
    "OBJECTIVES",
    "SCHEMA_PATH",
    "SCHEMA_VERSION",
    "Answer",
    "BaselineEntry",
    "CandidateVerdict",
    "IntervalEntry",
    "ObjectiveAnswer",
    "ObjectiveName",
    "Objectives",
    "Provenance",
    "ReasonEntry",
    "Recommendation",
    "ReferenceProfile",
    "ServingProfile",
    "StandardName",
    "VerdictDocument",
    "json_schema",
    "validate_verdict",
    "validate_verdict_file",
]

SCHEMA_VERSION = "ditq-verdict-3"  # 2: an answer per objective, with intervals; 3: two fidelity standards
SCHEMA_PATH = Path(__file__).with_name("verdict.schema.json")

ReasonCode = Literal[
    "stage_failure",
    "incomplete_run",
    "doctor_failure",
    "failed_requests",
    "out_of_memory",
    "collapsed_outputs",
    "baseline_collapsed",
    "no_gate_result",
    "outside_parity_band",
    "no_fidelity_result",
    "baseline_images",
    "undecided_parity_band",
    "below_lossless",
    "undecided_lossless",
    "slower_than_baseline",
    "faster_than_baseline",
    "same_speed_as_baseline",
    "undecided_speed",
    "no_speed_comparison",
    "reference_kernels",
    "smaller_weights",
    "larger_weights",
    "larger_peak_memory",
    "no_memory_comparison",
]
Answer = Literal["YES", "NO", "UNDECIDED"]
StandardName = Literal["lossless", "parity"]
ObjectiveName = Literal["fit_to_serve", "faster", "smaller"]
OBJECTIVES: dict[str, ObjectiveName] = {
    "fit": "fit_to_serve",
    "speed": "faster",
    "memory": "smaller",
}  # --objective


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
    parallel: str | None = Field(
        None,
        description="the --parallel setting(s) its served requests were served at (cp=2); null: one device",
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


class IntervalEntry(_Strict):
    """One measured comparison behind an answer, with its confidence interval where it has one."""

    subject: str = Field(
        description="what is compared: a fixture id, '2 references', 'weights', 'peak memory'"
    )
    measure: Literal[
        "psnr_minus_reference_db",
        "psnr_db",
        "ssim",
        "time_ratio",
        "device_time_ratio",
        "weight_ratio",
        "peak_memory_ratio",
    ] = Field(
        description="psnr_minus_reference_db: the candidate's PSNR against the baseline minus the reference "
        "pair's (or the stated band's), mean over seeds (the parity standard); psnr_db, ssim: the mean over seeds "
        "against the baseline (the lossless standard); the ratios: candidate / baseline; device_time_ratio: of "
        "seconds per image times the devices each generated on, where their device counts differ"
    )
    estimate: float | None
    low: float | None = Field(description="the interval's low end; null: no interval (measured once)")
    high: float | None
    confidence: float | None = Field(description="two-sided, e.g. 0.95; null: no interval")
    n: int | None = Field(
        description="samples: seeds (pairs) for PSNR, warm requests (the smaller side) for time"
    )
    method: str = Field(description="e.g. 'paired bootstrap', 'unpaired bootstrap', 'measured once'")
    threshold: str = Field(
        description="what the interval is held against, e.g. 'floor -1 dB', 'at least 40 dB', '1 +/- 0.05'"
    )
    decision: Literal[
        "inside", "outside", "undecided", "faster", "slower", "same", "smaller", "larger", "not larger"
    ]
    samples_to_settle: int | None = Field(
        description="about how many seeds (requests) would decide an undecided comparison; null: cannot tell"
    )
    samples_added: int | None = Field(
        default=None,
        description="seeds a sweep with --seeds auto added to this fixture, beyond the ones it started from, "
        "to decide it (n includes them); null: none added",
    )


class ObjectiveAnswer(_Strict):
    answer: Answer
    reasons: list[ReasonEntry] = Field(
        description="why: one sentence each; empty for a YES with nothing to add"
    )
    intervals: list[IntervalEntry]
    settle_command: str | None = Field(
        default=None,
        description="for an UNDECIDED answer: the command that settles it (more seeds, more requests, or the "
        "same sweep on a GPU for CPU timings); null for a YES or NO",
    )


class Objectives(_Strict):
    fit_to_serve: ObjectiveAnswer = Field(
        description="no stage or doctor failure, every request served within the memory budget, no collapse, "
        "every fixture's fidelity decided inside the document's standard"
    )
    fit_by_standard: dict[StandardName, ObjectiveAnswer] = Field(
        description="fit to serve under each fidelity standard: lossless (PSNR and SSIM above stated thresholds) "
        "and parity (as close as a second acceptable run); fit_to_serve is the document's standard's"
    )
    faster: ObjectiveAnswer = Field(
        description="faster than the baseline at every reference count both served"
    )
    smaller: ObjectiveAnswer = Field(
        description="smaller weights and no larger peak memory than the baseline"
    )


class CandidateVerdict(_Strict):
    name: str
    verdict: Answer = Field(description="the headline: the answer of the document's objective")
    reasons: list[ReasonEntry] = Field(description="the headline objective's reasons")
    objectives: Objectives
    profile: ServingProfile
    run: str | None = Field(description="the run directory the numbers come from")
    parity_floor_db: float | None

    def summary(self, objective: ObjectiveName, standard: StandardName = "lossless") -> str:
        """'w8a16: YES (fit_to_serve, lossless; parity NO; faster NO, smaller YES) - reasons', then for an UNDECIDED
        answer the command that settles it: the line the commands print."""
        fit = self.objectives.fit_to_serve
        other = [
            f"{name} {answer.answer}"
            for name, answer in self.objectives.fit_by_standard.items()
            if name != standard
        ]
        rest = [
            f"{name} {getattr(self.objectives, name).answer}"
            for name in OBJECTIVES.values()
            if name != objective
        ]
        head = f"{objective}, {standard}" if objective == "fit_to_serve" else objective
        parts = "; ".join(p for p in (head, ", ".join(other), ", ".join(rest)) if p)
        reasons = " ".join(r.message for r in self.reasons) or "every check passed."
        line = f"{self.name}: {self.verdict} ({parts}) - {reasons}"
        headline = fit if objective == "fit_to_serve" else getattr(self.objectives, objective)
        if headline.answer == "UNDECIDED" and headline.settle_command:
            line += f" To settle it: {headline.settle_command}"
        return line


class Recommendation(_Strict):
    candidate: str | None = Field(description="the candidate to serve; null: none is fit to serve")
    why: str = Field(min_length=1, description="one sentence")
    others: dict[str, str] = Field(description="every other candidate -> one sentence on why not")


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
    schema_version: Literal["ditq-verdict-3"]
    generated_utc: str
    objective: ObjectiveName = Field(description="the objective every candidate's headline verdict answers")
    standard: StandardName = Field(description="the fidelity standard fit_to_serve uses")
    standards: dict[StandardName, str] = Field(description="each standard's rule, in words")
    recommendation: Recommendation
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
    """Parse and check a verdict document; raise InputError naming the first bad field, or saying that the
    document is of another schema version."""
    version = document.get("schema_version") if isinstance(document, dict) else None
    if version is not None and version != SCHEMA_VERSION:
        raise InputError(
            f"{where}: schema_version {version!r} is not {SCHEMA_VERSION!r} (a verdict from another ditq; "
            "run ditq report again over its runs)"
        )
    return parse(VerdictDocument, document, where)


def validate_verdict_file(path: Path) -> VerdictDocument:
    path = Path(path)
    return validate_verdict(read_json(path), str(path))
