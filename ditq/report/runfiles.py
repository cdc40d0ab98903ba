"""The producers' files as the report reads them, typed: a sweep's CANDIDATE.json and offload attempts, and
the parts of a run's RUN.json that describe its servers (``invocations``) and its memory sampling (``memory``).

The shapes are the writers' (``ditq.sweep`` for CANDIDATE.json and ``logs/baseline-attempts.json``,
``ditq.probe.runner`` for RUN.json, ``ditq serve``'s GET /health for ``health``). A file that does not match
is an InputError naming the file and the field, except a server's /health: another server (vLLM-Omni, say)
describes itself in its own words, so a /health body that is not ditq serve's shape is read as unknown.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from ditq.errors import InputError

__all__ = [
    "Attempt",
    "CandidateFile",
    "DoctorSummary",
    "Invocation",
    "MemoryCapFacts",
    "MemoryDescription",
    "ServerEntry",
    "ServerHealth",
    "StageEntry",
    "WeightBytes",
    "parse",
    "read_attempts",
]


M = TypeVar("M", bound=BaseModel)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MemoryCapFacts(_Strict):
    """``ditq serve --max-memory`` on one CUDA device (ditq.serve.startup.MemoryCap.to_json)."""

    device: str
    budget_bytes: int  # everything the server process may hold on the device
    outside_allocator_bytes: int  # CUDA context and libraries, measured at start-up
    allocator_bytes: int  # the caching allocator's cap: budget - outside
    device_total_bytes: int


class DoctorStatus(_Strict):
    status: str
    summary: str


class ServerHealth(BaseModel):
    """What ditq serve says on GET /health once ready. Fields it may add later are ignored, not refused: the
    server describes itself, and a report of older runs must still read."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    status: str | None = None
    model: str | None = None
    device: str | None = None  # "cuda:0", "cpu"
    offload: str | None = None  # none | model | block
    dtype: str | None = None
    max_memory: MemoryCapFacts | None = None
    load_seconds: float | None = None  # reading the weights onto the device, kernel choice included
    kernel_choice_seconds: float | None = (
        None  # of which: the doctor's checks choosing paths (compilation too)
    )
    ready_seconds: float | None = None  # load + the doctor's start-up check
    kernel_paths: dict[str, int] = {}  # kernel path -> quantized layers that use it
    doctor: DoctorStatus | None = None

    @property
    def cuda_index(self) -> int | None:
        """The CUDA index of ``device`` ("cuda:1" -> 1), as the probe's memory sampler reads it."""
        device = self.device or ""
        return int(device[5:]) if device.startswith("cuda:") and device[5:].isdigit() else None


class ServerEntry(_Strict):
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


class Invocation(_Strict):
    """One ``ditq probe`` / ``ditq baseline`` call over a run directory: one start of its server(s)."""

    index: int
    started_utc: str
    planned: int
    retry: Literal["failed", "out_of_memory"] | None
    servers: list[ServerEntry]


class MemoryDescription(BaseModel):
    """RUN.json ``memory``: how the probe sampled accelerator memory, and what its peaks measure."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str  # nvml | nvidia-smi | unavailable
    interval_s: float
    pid: int | None
    reason: str | None
    # written since the probe prefers the server process's memory; None in runs from before
    device: int | None = None
    measures: str | None = None  # "server process (driver count)" or "whole device ..."


class Attempt(_Strict):
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


class StageEntry(_Strict):
    status: Literal["ok", "failed", "skipped"]
    seconds: float | None = None
    command: str | None = None
    message: str | None = None


class DoctorSummary(_Strict):
    passed: bool
    failing: list[str] = []
    checked: int | None = None
    report: str | None = None


class WeightBytes(_Strict):
    artifact: int  # the quantized component's weight files in the artifact
    source: int  # the same component's weight files in the source model


class CandidateFile(_Strict):
    """A sweep's ``OUT/<scheme>/CANDIDATE.json``."""

    name: str
    scheme: str | None = None
    artifact: str | None = None
    artifact_digest: str | None = None
    weight_bytes: dict[str, WeightBytes] | None = None  # quantized component -> bytes
    max_memory: str | None = None
    endpoint: str | None = None
    run: str = "run"
    doctor: DoctorSummary | None = None
    offload: list[str] = []  # the ladder the sweep climbed
    attempts: list[Attempt] = []
    stages: dict[str, StageEntry] = {}


def parse(model: type[M], raw: Any, where: str) -> M:
    """``raw`` as ``model``, or an InputError naming ``where`` and the first bad field."""
    try:
        return model.model_validate(raw)
    except ValidationError as error:
        first = error.errors()[0]
        location = ".".join(str(part) for part in first["loc"]) or "(top level)"
        raise InputError(f"{where}: {location}: {first['msg']}") from None


def read_attempts(path: Path) -> list[Attempt]:
    """A sweep's ``logs/baseline-attempts.json``: the baseline's offload attempts, in ladder order."""
    try:
        raw = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise InputError(f"{path}: no such attempts file") from None
    except json.JSONDecodeError as error:
        raise InputError(f"{path}: not valid JSON ({error.msg} at line {error.lineno})") from None
    if not isinstance(raw, list):
        raise InputError(f"{path}: expected a list of attempts")
    return [parse(Attempt, item, f"{path} attempt {i}") for i, item in enumerate(raw)]
