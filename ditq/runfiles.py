"""The files of a run directory and of a sweep, typed: one pydantic model per file, written and read through it.

The writers (``ditq probe`` / ``ditq baseline``, ``gate``, ``compare``, ``sweep``) build these models and
``write_model`` them; the readers (``gate``, ``compare``, the baseline's seal, the sweep's resume, ``report``)
``read_model`` them. Every model refuses a field it does not know (``extra="forbid"``), so no reader guesses a
key: a file that does not match is an InputError naming the file and the first bad field.

A field is written when its writer set it: an attempt that never served has no ``probe_command``, a running
RUN.json no ``counts``. Read back, an absent field takes its default, so a file reads back to the same model.

Times are seconds (``wall_s``, ``t_start``), except inside a server's response ``metrics``, which stay in the
server's words: ditq serve's ``StageMetrics`` and vLLM-Omni's are milliseconds (``*_ms``) and
``peak_memory_mb``; the in-process baseline writes the same shape. A server's /health body is read loosely too
(``ServerEntry.health``). The seed probe's ``matrix.json`` is not a ditq file: one adapter at the edge
(``ditq.probe.records``) turns it into ``ProbeRecord``.

A run directory::                        A sweep::

    RUN.json       RunFile                   SWEEP.json                    SweepFile
    records.jsonl  ProbeRecord per line      <scheme>/CANDIDATE.json       CandidateFile
    SEAL.json      SealFile (a baseline)     logs/baseline-attempts.json   list[Attempt]
    gate.json      GateFile                  <scheme>/doctor.json          DoctorFile
    compare.json   CompareFile
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    RootModel,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

from ditq import jsonfile
from ditq.errors import InputError
from ditq.fsutil import atomic_write_json

__all__ = [
    "ATTEMPTS_FILE",
    "BASELINE_COMMANDS_FILE",
    "CANDIDATE_FILE",
    "COMPARE_FILE",
    "GATE_FILE",
    "IMAGES_DIR",
    "RECORDS_FILE",
    "RUN_FILE",
    "SEAL_FILE",
    "SWEEP_FILE",
    "Attempt",
    "CandidateFile",
    "CommandList",
    "CompareFile",
    "CompareRow",
    "DoctorCheck",
    "DoctorEnvironment",
    "DoctorFile",
    "DoctorPath",
    "DoctorSummary",
    "FidelityOverall",
    "FidelityStats",
    "FixtureFidelity",
    "GateFile",
    "GateRecord",
    "GateSummary",
    "HttpOptions",
    "InProcessOptions",
    "Invocation",
    "LoraAdapterFacts",
    "LoraFacts",
    "LosslessDecision",
    "LosslessMeasure",
    "LosslessResult",
    "MemoryCapFacts",
    "MemoryDescription",
    "MemorySource",
    "ParallelFacts",
    "ParityDecision",
    "ParityResult",
    "PlacementFacts",
    "ProbeRecord",
    "RankFacts",
    "RunCounts",
    "RunDescription",
    "RunFile",
    "SealFile",
    "ServerEntry",
    "ServerHealth",
    "StageEntry",
    "Structure",
    "StructureSource",
    "SweepFile",
    "WeightBytes",
    "parse",
    "read_json",
    "read_model",
    "read_model_list",
    "set_digest",
    "to_json",
    "write_model",
]

RUN_FILE = "RUN.json"
RECORDS_FILE = "records.jsonl"
IMAGES_DIR = "images"
SEAL_FILE = "SEAL.json"
GATE_FILE = "gate.json"
COMPARE_FILE = "compare.json"
SWEEP_FILE = "SWEEP.json"
CANDIDATE_FILE = "CANDIDATE.json"
ATTEMPTS_FILE = "baseline-attempts.json"  # under a sweep's logs/
BASELINE_COMMANDS_FILE = "baseline-commands.json"  # under a sweep's logs/

M = TypeVar("M", bound=BaseModel)


class _File(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, serialize_by_alias=True)


def set_digest(per_fixture: Mapping[str, str]) -> str:
    """A fixture set's one sha256: over its sorted per-fixture digests (what RUN.json's ``fixture_digest`` is)."""
    return hashlib.sha256(json.dumps(sorted(per_fixture.items())).encode()).hexdigest()


# The time ``ditq probe`` may spend between a request's t_start and t_end outside its wall_s and waited_s: two
# memory samples (an nvidia-smi call each, where NVML is missing); a record whose wall_s falls short by more is edited
WALL_SLACK_S = 1.0
WALL_SLACK_FRACTION = 0.25


# -- records.jsonl -----------------------------------------------------------------------------------------


class Structure(_File):
    """An image's structure numbers (``ditq.metrics.structure_metrics``, named in ``ditq.metrics.METRICS``).
    The seed probe recorded only opaque_fraction, alpha_mean and rgb_std."""

    opaque_fraction: float | None = None
    translucent_fraction: float | None = None
    alpha_mean: float | None = None
    rgb_std: list[float] | None = None
    rgb_std_mean: float | None = None
    banding_score: float | None = None
    clipped_fraction: float | None = None
    non_finite: bool | None = None
    flat: bool | None = None

    def as_metrics(self) -> dict[str, Any]:
        """Metric name -> value, for the gate's rules (which name metrics as data)."""
        return self.model_dump(exclude_none=True)


# A measured quantity read back from a file: finite and not negative (a negative or NaN duration would be believed
# by every speed answer, and NaN is not JSON)
Measured = Annotated[float, Field(ge=0, allow_inf_nan=False)]


def _check_metrics(value: Any, where: str = "metrics") -> None:
    """Every number in a response's metrics is finite, and every time or size (a name ending ``_ms``, ``_s``,
    ``_mb``, ``_mib``, ``_bytes``) is not negative: lists and nested objects included."""
    if isinstance(value, dict):
        for key, item in value.items():
            _check_metrics(item, f"{where}.{key}")
    elif isinstance(value, list):
        for item in value:
            _check_metrics(item, where)
    elif isinstance(value, float | int) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ValueError(f"{where} is {value}, not a finite number")
        unit = where.rsplit(".", 1)[-1]
        if unit.endswith(("_ms", "_s", "_mb", "_mib", "_bytes")) and value < 0:
            raise ValueError(f"{where} is {value}: a time or size cannot be negative")


class ProbeRecord(_File):
    """One request of the matrix: one line of records.jsonl. Times and sizes are finite and not negative, also in
    the server's own metrics."""

    # integers are integers: a record's "200" or 1.0 is refused, not read as a number
    fixture_id: str
    seed: StrictInt
    n_references: StrictInt = Field(ge=0)
    steps: StrictInt = Field(ge=0)
    true_cfg_scale: float = Field(allow_inf_nan=False)
    size: str  # "WxH"
    endpoint: str | None  # a server's base URL, "in-process"; None: the seed's record
    offload: str | None = None  # the server's offload mode where its /health said (absent before 372e5b4)
    parallel: str | None = None  # the server's --parallel (cp=2) where its /health said; None: one device
    invocation: int | None = None  # the run's invocation (server start) that sent it (absent before 372e5b4)
    t_start: Measured | None  # unix seconds; None: the seed's record
    t_end: Measured | None
    wall_s: Measured
    waited_s: Measured | None = None  # waiting for a server that went away, then answered (absent: none)
    http: StrictInt | None  # None: no HTTP answer (in process, a timeout, a refused connection)
    bytes: StrictInt | None
    sha256: str | None
    structure: Structure | None
    usage: dict[str, Any] | None  # the response's usage, in the server's words
    metrics: dict[str, Any] | None  # the response's metrics, in the server's words (ms)
    error: str | None
    error_code: str | None = (
        None  # an OpenAI error envelope's code, e.g. out_of_memory (absent before 372e5b4)
    )
    peak_memory_mib: Measured | None  # sampled over the request's window (the server process's, where known)

    @field_validator("metrics")
    @classmethod
    def _finite_metrics(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        _check_metrics(value)
        return value

    @model_validator(mode="after")
    def _wall_within_its_window(self) -> ProbeRecord:
        """wall_s (and any waited_s) is measured inside [t_start, t_end]: it can neither exceed that window nor
        fall far short of it."""
        if self.t_start is None or self.t_end is None:
            return self
        span, measured = self.t_end - self.t_start, self.wall_s + (self.waited_s or 0.0)
        if measured > span + 0.01 or measured < span - WALL_SLACK_S - WALL_SLACK_FRACTION * span:
            raise ValueError(
                f"wall_s {self.wall_s:g} is not the time between t_start and t_end ({span:.3f} s): an edited record"
            )
        return self

    @property
    def key(self) -> tuple[str, int]:
        return (self.fixture_id, self.seed)

    @property
    def server_peak_mib(self) -> float | None:
        """The peak the server itself reported for this request (``metrics.peak_memory_mb``, ditq serve's and
        vLLM-Omni's name), where it did."""
        value = (self.metrics or {}).get("peak_memory_mb")
        return float(value) if isinstance(value, int | float) else None


# -- RUN.json ------------------------------------------------------------------------------------------------


class MemoryCapFacts(_File):
    """``ditq serve --max-memory`` on one CUDA device (ditq.serve.startup.MemoryCap.to_json)."""

    device: str
    budget_bytes: int  # everything the server process may hold on the device
    outside_allocator_bytes: int  # CUDA context and libraries, measured at start-up
    allocator_bytes: int  # the caching allocator's cap: budget - outside
    device_total_bytes: int


class DoctorStatus(_File):
    status: str
    summary: str


class PlacementFacts(BaseModel):
    """``--offload auto``'s placement as /health shows it (``ditq.runtime.offload.Placement.to_json``)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    resident: list[str] = []
    streamed: list[str] = []
    vae_tiling: bool = False
    transfer_gbps: float | None = None  # pinned host -> device, measured at start-up
    demotions: list[str] = []  # what calibration moved, in order


class LoraAdapterFacts(BaseModel):
    """One LoRA adapter a server loaded (``ditq serve --lora``), as /health shows it (``LoadedLora.to_json``)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    name: str
    scale: float
    layers: int
    parameter_bytes: int


class LoraFacts(BaseModel):
    """``ditq serve --lora``'s adapters as /health shows them (``LoraAdapters.to_json``)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    adapters: list[LoraAdapterFacts] = []
    parameter_bytes: int = 0


class CompiledFacts(BaseModel):
    """``--compile`` as /health shows it (``ditq.runtime.compile.CompileFacts.to_json``)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    backend: str
    module: str = "transformer"
    how: str = ""
    warmup_seconds: float | None = None  # the first call at each calibrated shape: compilation and warm-up
    warmup_graphs: int | None = None  # graphs compiled during the warm-up
    graphs_since_warmup: int | None = None  # graphs compiled after it: requests that paid a compilation
    cache_hits: int | None = None  # warm-up graphs whose code came from the compile cache (a warm start)
    cache_misses: int | None = None  # warm-up graphs compiled anew (a cold start)


class RankFacts(BaseModel):
    """One rank of a parallel server as /health shows it (``ditq.serve.ranks.RankGroup.to_json``)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    rank: int
    device: str
    pid: int | None = None
    alive: bool = True
    # of its process so far: the CUDA allocator's, or resident on the CPU
    peak_memory_bytes: int | None = None


class ParallelFacts(BaseModel):
    """``--parallel`` as /health shows it: the mode and degree, the backend, every rank's device and peak."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    mode: str  # cp | tp
    degree: int
    backend: str | None = None  # nccl | gloo
    devices: list[str] = []
    ranks: list[RankFacts] = []
    lost: str | None = None  # why the ranks serve no more (the server is degraded)

    @property
    def label(self) -> str:
        return f"{self.mode}={self.degree}"

    @staticmethod
    def degree_of(label: str) -> int:
        """``label``'s degree (cp=2 -> 2): what a record keeps of the facts."""
        return int(label.split("=")[1])


class ServerHealth(BaseModel):
    """What ditq serve says on GET /health once ready. Fields it may add later are ignored, not refused: the
    server describes itself, and a report of older runs must still read."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    status: str | None = None
    model: str | None = None
    artifact_digest: str | None = (
        None  # sha256 of the served artifact's MANIFEST.json; None: not a ditq artifact
    )
    device: str | None = None  # "cuda:0", "cpu"
    offload: str | None = None  # none | model | block
    dtype: str | None = None
    max_memory: MemoryCapFacts | None = None
    # the CUDA allocator where ditq fits the model (--offload auto, --max-memory): expandable_segments, or
    # "environment: ..." where PYTORCH_CUDA_ALLOC_CONF set it; None: the allocator's default, or older servers
    allocator: str | None = None
    load_seconds: float | None = None  # reading the weights onto the device, kernel choice included
    kernel_choice_seconds: float | None = (
        None  # of which: the doctor's checks choosing paths (compilation too)
    )
    ready_seconds: float | None = None  # load + the doctor's start-up check
    # component -> scheme -> quantized Linears (several schemes in one component: a mixed-precision plan)
    quantized: dict[str, dict[str, int]] = {}
    kernel_paths: dict[str, int] = {}  # kernel path -> quantized layers that use it
    attention: str | None = None  # the quantized-attention choice (serve --attention); None: the model's own
    doctor: DoctorStatus | None = None
    placement: PlacementFacts | None = None  # --offload auto: what is resident, what streams
    unused: dict[
        str, int
    ] = {}  # component.module -> bytes left out of the loaded model (the manifest's unused)
    kv_cache: str | None = None  # serve --kv-cache: the prefix KV cache's precision; None: the model's own
    lora: LoraFacts | None = None  # serve --lora: the adapters loaded, each at its scale; None: none
    cache: str | None = (
        None  # serve --cache: the step cache's setting (first-block:0.1); None: every step computed
    )
    accumulate: str | None = (
        None  # serve --accumulate: exact | fast (fp8 GEMMs' accumulation); None: older servers
    )
    calibration_seconds: float | None = None  # measuring the cost model at start-up
    compile: CompiledFacts | None = None  # serve --compile; None: eager
    parallel: ParallelFacts | None = None  # serve --parallel; None: one device

    @property
    def cuda_index(self) -> int | None:
        """The CUDA index of ``device`` ("cuda:1" -> 1), as the probe's memory sampler reads it."""
        device = self.device or ""
        return int(device[5:]) if device.startswith("cuda:") and device[5:].isdigit() else None


class ServerEntry(_File):
    endpoint: str
    health: Any = None  # the /health body as the probe got it (null: none readable); see ``facts``

    @property
    def facts(self) -> ServerHealth | None:
        """The body as ditq serve's health, or None: no body, or another server's words."""
        if not isinstance(self.health, dict):
            return None
        try:
            return ServerHealth.model_validate(self.health)
        except ValidationError:
            return None

    @property
    def cuda_index(self) -> int | None:
        facts = self.facts
        return None if facts is None else facts.cuda_index


class Invocation(_File):
    """One ``ditq probe`` / ``ditq baseline`` call over a run directory: one start of its server(s)."""

    index: int
    started_utc: str
    planned: int
    retry: Literal["failed", "out_of_memory"] | None
    servers: list[ServerEntry]


MemorySource = Literal["nvml", "nvidia-smi", "unavailable"]


class MemoryDescription(_File):
    """How the probe sampled accelerator memory, and what its peaks measure."""

    source: MemorySource
    interval_s: float
    pid: int | None  # the server process whose own memory is sampled, where given
    reason: str | None  # why sampling is unavailable
    device: int | None = None  # the server's CUDA index (absent before 372e5b4)
    measures: str | None = (
        None  # "server process (driver count)" or "whole device ..." (absent before 372e5b4)
    )


class HttpOptions(_File):
    """A run through endpoints: its request settings."""

    concurrency: int  # requests in flight per endpoint
    timeout_s: float
    model: str | None  # the ``model`` field sent with each request


class InProcessOptions(_File):
    """The in-process baseline: where the pipeline ran."""

    device: str
    offload: str
    compile: str | None = None  # the torch.compile backend of the transformer (--compile); None: eager


class RunCounts(_File):
    planned: int
    skipped: int
    completed: int
    failed: int


class RunDescription(_File):
    """What a run is: written before its first request, checked when it is resumed."""

    schema_version: Literal["ditq-run-v1"] = Field(alias="schema")
    kind: Literal["probe", "baseline"]
    model: str | None = None  # a baseline's model directory
    endpoints: list[str]  # ["in-process"] for the in-process baseline
    fixtures_file: str
    fixture_ids: list[str]
    fixture_digest: str
    fixture_digests: dict[str, str]  # fixture id -> digest of its prompt, size and reference images
    refs_dir: str
    seeds: list[int]
    steps: int
    true_cfg_scale: float
    options: HttpOptions | InProcessOptions
    versions: dict[str, str]

    @model_validator(mode="after")
    def _consistent(self) -> RunDescription:
        """Seeds and fixtures each once; the set's digest is the one its fixtures' digests give."""
        for what, values in (("seeds", self.seeds), ("fixture_ids", self.fixture_ids)):
            repeated = next((v for i, v in enumerate(values) if v in values[:i]), None)
            if repeated is not None:
                raise ValueError(f"{what} lists {repeated!r} twice")
        if set(self.fixture_ids) != set(self.fixture_digests):
            raise ValueError("fixture_ids and fixture_digests name different fixtures")
        if self.fixture_digest != set_digest(self.fixture_digests):
            raise ValueError("fixture_digest is not the digest of fixture_digests: an edited RUN.json")
        return self


class RunFile(RunDescription):
    """RUN.json: the description, one entry per invocation, the memory sampling and, once not running, counts."""

    invocations: list[Invocation]
    memory: MemoryDescription
    started_utc: str
    # complete: every planned request (fixtures x seeds) has a record; failed: the probe stopped on an error
    # (a write error, say), named in ``failure``; interrupted: stopped by Ctrl-C. A rerun resumes the last two.
    status: Literal["running", "interrupted", "failed", "complete"]
    failure: str | None = None  # why a failed run stopped (absent before the failed status)
    finished_utc: str | None = None  # these three once the status is no longer "running"
    peak_memory_mib: float | None = None
    counts: RunCounts | None = None

    @classmethod
    def of(cls, description: RunDescription, **state: Any) -> RunFile:
        return cls.model_validate({**description.model_dump(exclude_unset=True), **state})


# -- SEAL.json -----------------------------------------------------------------------------------------------


class SealFile(_File):
    schema_version: Literal["ditq-seal-v1"] = Field(alias="schema")
    sealed_utc: str
    files: dict[str, str]  # path in the run directory -> sha256
    fixture_digest: str
    versions: dict[str, str]


# -- gate.json -----------------------------------------------------------------------------------------------


StructureSource = Literal["image", "recorded", "undecodable image", "image not the recorded one", "none"]


class GateRecord(_File):
    """One image judged. Each reason and inherited entry begins with its rule's name ("transparent: ...")."""

    fixture_id: str
    seed: int
    n_references: int
    passed: bool
    reasons: list[str]
    unchecked: list[str]
    inherited: list[str] = []  # signatures the baseline's image shows too (absent before a1a0907)
    structure: Structure | None
    structure_source: StructureSource
    wall_s: float
    peak_memory_mib: float | None
    peak_memory_source: Literal["sampled", "server"] | None  # over the request's window | the server's report

    @property
    def failed_rules(self) -> list[str]:
        """The names of the rules it failed ("transparent", "drift", "request failed", ...)."""
        return _rule_names(self.reasons)

    @property
    def inherited_rules(self) -> list[str]:
        return _rule_names(self.inherited)


def _rule_names(texts: list[str]) -> list[str]:
    return list(dict.fromkeys(text.split(":")[0].strip() for text in texts))


class GateSummary(_File):
    """The images of one reference count."""

    n: int
    passes: int
    wall_min_s: float | None
    wall_max_s: float | None
    wall_mean_s: float | None
    peak_memory_mib: float | None
    peak_memory_source: str  # "sampled", "server", both joined by "/", or ""


class GateFile(_File):
    run: str
    format: Literal["ditq", "seed-matrix"]
    baseline: str | None  # the baseline and its seal status, where one was given
    rules: str
    verdict: Literal["PASS", "FAIL"]
    passes: int
    n: int
    run_peak_memory_mib: float | None
    run_peak_source: str  # "vram.csv", "records: server-reported peak_memory_mb" or "unavailable"
    by_references: dict[int, GateSummary]
    records: list[GateRecord]


# -- compare.json --------------------------------------------------------------------------------------------


class CompareRow(_File):
    """One image against the baseline's: ok (with its numbers), missing, or error."""

    fixture_id: str
    seed: int
    n_references: int
    status: Literal["ok", "missing", "error"]
    error: str | None = None
    psnr_db: float | None = None  # capped at ditq.judge.compare.PSNR_CAP_DB for identical images
    ssim: float | None = None
    space: Literal["RGBA", "RGB over white"] | None = None
    lpips: float | None = None  # only where LPIPS ran
    same_bytes: bool | None = (
        None  # True where the image is the baseline's, byte for byte (written only then)
    )
    # the candidate's server ran a step cache (--cache): the steps of this request it served from the cache
    skipped_steps: int | None = None


class FidelityStats(_File):
    mean: float | None
    min: float | None
    max: float | None


class ParityDecision(_File):
    """One fixture against its parity band, decided on an interval (``ditq.judge.stats``).

    The sample is the candidate's PSNR minus the reference pair's, seed by seed (paired), or minus the stated
    band's PSNR; the fixture is inside when the interval's low end reaches ``floor_db`` (minus the tolerance),
    outside when its high end does not, undecided otherwise.
    """

    reference: Literal["pair", "stated"]
    difference_db: float | None  # mean of candidate - reference (None: fewer than 2 images to judge)
    low_db: float | None
    high_db: float | None
    confidence: float
    method: str  # "paired bootstrap", "unpaired bootstrap", "bootstrap against a stated PSNR", "none"
    n: int  # seeds (pairs) the interval is taken over
    floor_db: float  # the lowest acceptable difference: minus the tolerance
    decision: Literal["inside", "outside", "undecided"]
    seeds_to_settle: int | None  # about how many seeds would decide it (n when decided; None: cannot tell)


class LosslessMeasure(_File):
    """One measure of a fixture (PSNR in dB, or SSIM) over its seeds: the mean with its interval, held against
    the standard's threshold."""

    estimate: float | None  # the mean over seeds (None: no image compared)
    low: float | None  # the interval (None: fewer than 2 images)
    high: float | None
    threshold: float  # the lowest acceptable mean
    decision: Literal["inside", "outside", "undecided"]
    seeds_to_settle: int | None


class LosslessDecision(_File):
    """One fixture against the visually lossless standard (``ditq.judge.compare.LosslessStandard``): inside
    when both intervals clear their thresholds, outside when either lies wholly below its threshold, undecided
    otherwise."""

    psnr_db: LosslessMeasure
    ssim: LosslessMeasure
    confidence: float
    method: str  # "bootstrap" (of the mean over seeds), or "none" with fewer than 2 images
    n: int  # seeds the intervals are taken over
    decision: Literal["inside", "outside", "undecided"]
    seeds_to_settle: int | None  # about how many seeds would decide it (n when decided; None: cannot tell)


class LosslessResult(_File):
    """The visually lossless standard a compare held every fixture against, and its overall decision."""

    psnr_db: float  # the thresholds
    ssim: float
    inside: bool  # every fixture inside and every image compared
    decision: Literal["inside", "outside", "undecided"]


class FixtureFidelity(_File):
    n: int
    ok: int
    missing: int
    errors: int
    psnr_db: FidelityStats
    ssim: FidelityStats
    lpips: FidelityStats | None = None
    parity_edge_db: float | None = None  # the band's PSNR minus the tolerance, with a band and an ok row
    inside_parity_band: bool | None = None  # files from before intervals: the mean PSNR reached the edge
    parity: ParityDecision | None = None  # with a band and at least one ok row
    lossless: LosslessDecision | None = None  # with at least one ok row (absent before the lossless standard)


class FidelityOverall(_File):
    n: int
    ok: int
    psnr_db: FidelityStats
    ssim: FidelityStats


class ParityResult(_File):
    """The parity band: per fixture, the reference pair's PSNR (its mean here; per seed in ``per_seed_db``) or
    the stated PSNR, minus the tolerance."""

    source: str  # "stated" or "pair A vs B"
    overall_db: float
    per_fixture_db: dict[str, float]
    per_seed_db: dict[str, dict[int, float]] | None = None  # a pair's PSNR per fixture and seed
    tolerance_db: float
    inside: bool  # every fixture inside and every image compared
    # outside: a fixture is outside; undecided: none is, and one is undecided or an image is missing; None:
    # files from before intervals
    decision: Literal["inside", "outside", "undecided"] | None = None

    @property
    def floor_db(self) -> float:
        return self.overall_db - self.tolerance_db


class CompareFile(_File):
    run: str
    baseline: str
    baseline_seal: str  # "sealed" or "unsealed (allowed): ..."
    lpips_note: str
    rows: list[CompareRow]
    fixtures: dict[str, FixtureFidelity]
    overall: FidelityOverall
    parity: ParityResult | None
    lossless: LosslessResult | None = None  # absent before the lossless standard


# -- doctor.json (ditq doctor --json) and the doctor's verdicts ---------------------------------------------


class DoctorCheck(_File):
    """One step of a kernel path's isolation chain for one (geometry, weights, activation dtype)."""

    step: str  # load | scales | finite | output
    geometry: str  # "IN->OUT", with " gG" for grouped scales and " (label)"
    weights: str  # synthetic | analytic | artifact:<component>/<layer>
    dtype: str  # the activation dtype, "-" for the steps that take none (load, scales)
    passed: bool
    message: str
    value: float | None = None  # the output step's relative L2 (or max deviation for analytic weights)
    bound: float | None = None


class DoctorPath(_File):
    """One kernel path's verdict and every check behind it (a line of ``ditq doctor``'s table; the doctor's
    cache holds one per path, geometries and settings)."""

    path: str
    scheme: str
    device: str
    verdict: Literal["PASS", "FAIL", "SKIP"]
    reason: str = ""
    capability_overclaim: bool = False  # supports() offered the path on this device and it failed
    checks: list[DoctorCheck] = []
    report_dir: str | None = None  # a failing path's report directory
    worst_rel_l2: float | None = None  # the largest output-step value
    bound: float  # the relative-L2 bound of the output step

    @property
    def first_failure(self) -> DoctorCheck | None:
        return next((c for c in self.checks if not c.passed), None)


class DoctorEnvironment(_File):
    """Where the doctor ran: what a report states and what a cached verdict is keyed by."""

    device: str
    python: str
    platform: str
    torch: str
    cuda: str | None
    triton: str | None
    ditq: str
    gpu: str | None
    capability: str | None  # "9.0"
    driver: str | None
    cpu: str | None = None  # on the CPU: the processor


class DoctorFile(_File):
    """``ditq doctor --json FILE`` (a sweep's ``<scheme>/doctor.json``)."""

    command: str
    environment: DoctorEnvironment
    bound: float
    paths: list[DoctorPath]


# -- a sweep: SWEEP.json, CANDIDATE.json, the offload attempts ----------------------------------------------


class Attempt(_File):
    """One rung of a sweep's offload ladder: a server started at ``offload`` and, once healthy, probed."""

    offload: str
    command: str | None = None
    status: Literal["ok", "failed", "out_of_memory_at_load"]
    seconds: float | None = None
    ready_s: float | None = None  # from starting the server to /health 200, as the sweep measured it
    message: str | None = None
    probe_command: str | None = None
    exit_code: int | None = None
    out_of_memory_after: int | None = None  # requests still out of memory after this rung

    @property
    def loaded(self) -> bool:
        return self.probe_command is not None


class CommandList(RootModel[list[str]]):
    """A sweep's ``logs/baseline-commands.json``: the command lines behind its baseline (every server and probe
    of the offload ladder), as a JSON list."""


class StageEntry(_File):
    status: Literal["ok", "failed", "skipped"]
    seconds: float | None = None
    command: str | None = None
    message: str | None = None


class DoctorSummary(_File):
    passed: bool
    failing: list[str] = []
    checked: int | None = None
    report: str | None = None


class WeightBytes(_File):
    artifact: int  # the quantized component's weight files in the artifact
    source: int  # the same component's weight files in the source model


class CandidateFile(_File):
    """A sweep's ``OUT/<scheme>/CANDIDATE.json``, rewritten after every stage."""

    name: str
    scheme: str | None = None
    artifact: str | None = None
    artifact_digest: str | None = None
    weight_bytes: dict[str, WeightBytes] | None = None  # quantized component -> bytes
    max_memory: str | None = None
    endpoint: str | None = None
    run: str = Field(
        default="run", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
    )  # a folder of the candidate's
    doctor: DoctorSummary | None = None
    offload: list[str] = []  # the ladder the sweep climbed
    attempts: list[Attempt] = []
    stages: dict[str, StageEntry] = {}
    # --seeds auto: per fixture, the seeds the sweep added to decide it (absent: none added)
    seeds_added: dict[str, int] = {}
    seed_commands: list[str] = []  # --seeds auto: the servers and probes that added them, in order


class SweepFile(_File):
    """A sweep's ``OUT/SWEEP.json``: its options, the command and the model files it was made from."""

    command: str
    model: str
    model_fingerprint: dict[str, list[int]] | None = None  # file -> [size, mtime_ns] (absent before e332eb9)
    schemes: list[str]
    fixtures: str
    refs: str
    seeds: str | None
    steps: int | None
    max_memory: str | None
    offload: list[str]
    note: str | None
    variant: str | None = None  # the model's weight variant (absent before --variant)
    device: str
    dtype: str | None
    endpoint_for: dict[str, str]
    parity_db: float | None
    parity_pair: list[str] | None
    parity_in_process: bool = False  # the band from the baseline and the model run in process in bfloat16
    max_seeds: int | None = None  # --seeds auto: the most seeds a fixture may get
    plan: str | None = None  # --plan: the PLAN.json of the planned candidate, as given
    attention: str | None = None  # --attention: the candidates' servers' quantized attention (int8 | fp8)
    kv_cache: str | None = None  # --kv-cache: the candidates' servers' 8-bit prefix KV cache (int8 | fp8)
    cache: str | None = None  # --cache: the candidates' servers' step cache (first-block:0.1); None: none
    accumulate: str = "exact"  # --accumulate: the candidates' servers' fp8 accumulation (exact | fast)
    compile: str | None = (
        None  # --compile: every server's torch.compile backend, the baseline's too; None: eager
    )
    seeds_by_fixture: dict[str, str] | None = None  # --seeds auto: fixture -> the seeds it was run at
    lora: str | None = None  # --lora PATH:SCALE: the adapter every server loaded, the baseline's too
    pid: int


# -- reading and writing -----------------------------------------------------------------------------------


def parse(model: type[M], raw: Any, where: str) -> M:
    """``raw`` as ``model``, or an InputError naming ``where`` and the first bad field."""
    try:
        return model.model_validate(raw)
    except ValidationError as error:
        first = error.errors()[0]
        location = ".".join(str(part) for part in first["loc"]) or "(top level)"
        raise InputError(f"{where}: {location}: {first['msg'].removeprefix('Value error, ')}") from None


def read_json(path: Path) -> Any:
    """A run file's JSON value (``ditq.jsonfile``: bounded, every key once)."""
    return jsonfile.read_json(path)


def read_model(model: type[M], path: Path) -> M:
    return parse(model, read_json(path), str(path))


def read_model_list(model: type[M], path: Path) -> list[M]:
    """A JSON list of ``model`` (a sweep's offload attempts)."""
    raw = read_json(path)
    if not isinstance(raw, list):
        raise InputError(f"{path}: (top level): expected a list")
    return [parse(model, item, f"{path} item {i}") for i, item in enumerate(raw)]


def to_json(model: BaseModel) -> dict[str, Any]:
    """The fields its writer set, as JSON values."""
    return model.model_dump(mode="json", exclude_unset=True)


def write_model(path: Path, content: BaseModel | Sequence[BaseModel]) -> None:
    """Write a model (or a list of them) atomically, as ``read_model`` (``read_model_list``) reads it."""
    data = to_json(content) if isinstance(content, BaseModel) else [to_json(item) for item in content]
    atomic_write_json(path, data)
