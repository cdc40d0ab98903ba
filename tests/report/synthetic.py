"""Synthetic run directories in the run-directory contract: real PNGs (PIL); RUN.json and records written through
their models (ditq.runfiles), gate.json and compare.json by the gate and compare themselves.

The images are seeded patterns: the baseline draws a smooth scene per (fixture, seed); a
"healthy" candidate adds small seeded noise to it; a "collapsed" candidate writes transparent
horizontal stripes (the seed's broken int8 signature).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from ditq.judge.compare import ParityBand, compare_run
from ditq.judge.gate import gate_run, load_rules
from ditq.probe.records import RecordLog
from ditq.runfiles import (
    Attempt,
    CandidateFile,
    HttpOptions,
    Invocation,
    MemoryDescription,
    ProbeRecord,
    RunFile,
    ServerEntry,
    set_digest,
    write_model,
)

FIXTURES = {"fx-one": 1, "fx-two": 2, "fx-three": 3, "fx-four": 4}  # fixture id -> reference count
SEEDS = (2301, 2302)
ARTIFACT_DIGEST = "ab" * 32  # what a candidate's CANDIDATE.json names, and its servers say they served
SIZE = 32


def baseline_pixels(fixture_id: str, seed: int) -> np.ndarray:
    """(SIZE, SIZE, 4) uint8, opaque: a gradient and a disc whose place depends on fixture and seed."""
    rng = np.random.default_rng(seed * 31 + len(fixture_id))
    y, x = np.mgrid[0:SIZE, 0:SIZE]
    cx, cy = rng.integers(8, SIZE - 8, size=2)
    disc = ((x - cx) ** 2 + (y - cy) ** 2) < 36
    image = np.zeros((SIZE, SIZE, 4), np.uint8)
    image[..., 0] = (x * 255 // SIZE).astype(np.uint8)
    image[..., 1] = (y * 255 // SIZE).astype(np.uint8)
    image[..., 2] = np.where(disc, 230, 40)
    image[..., 3] = 255
    return image


def candidate_pixels(kind: str, fixture_id: str, seed: int) -> np.ndarray:
    base = baseline_pixels(fixture_id, seed)
    rng = np.random.default_rng(seed)
    if kind == "healthy":
        noisy = base.astype(np.int16) + rng.integers(-1, 2, size=base.shape)
        noisy[..., 3] = 255
        return np.clip(noisy, 0, 255).astype(np.uint8)
    if kind == "collapsed":
        stripes = np.zeros_like(base)
        stripes[::2, :, :3] = rng.integers(0, 255, size=(SIZE // 2, 1, 3))
        stripes[..., 3] = 20
        return stripes
    raise ValueError(kind)


@dataclass
class RunSpec:
    label: str
    kind: str  # "baseline" | "healthy" | "collapsed"
    wall_by_refs: dict[int, float]  # mean seconds per image
    oom_refs: tuple[int, ...] = ()  # reference counts whose requests run out of memory
    fail_refs: tuple[int, ...] = ()  # reference counts whose requests get a 500
    parity_db: float | None = 30.0  # the parity band compare is given (None: none)
    memory_mib: tuple[float, ...] = ()  # a vram.csv series, one sample a second
    gate: bool = True
    compare: bool = True
    parallel: str | None = None  # the server's --parallel (cp=2); None: one device


def run_file(kind: str, invocations: list[Invocation], memory: MemoryDescription | None = None) -> RunFile:
    """RUN.json of a finished run over FIXTURES x SEEDS."""
    return RunFile.model_validate(
        {
            "schema": "ditq-run-v1",
            "kind": kind,
            "model": "models/bf16" if kind == "baseline" else None,
            "endpoints": ["http://127.0.0.1:9000"],
            "fixtures_file": "fixtures.json",
            "fixture_ids": list(FIXTURES),
            "fixture_digest": set_digest(dict.fromkeys(FIXTURES, "f" * 64)),
            "fixture_digests": dict.fromkeys(FIXTURES, "f" * 64),
            "refs_dir": "refs",
            "seeds": list(SEEDS),
            "steps": 4,
            "true_cfg_scale": 1.0,
            "options": HttpOptions(concurrency=1, timeout_s=60.0, model=None),
            "versions": {"ditq": "test"},
            "invocations": invocations,
            "memory": memory
            or MemoryDescription(source="unavailable", interval_s=1.0, pid=None, reason="no GPU"),
            "started_utc": "2026-11-30T12:00:00+00:00",
            "status": "complete",
        }
    )


def record(fixture_id: str, seed: int, **fields: Any) -> ProbeRecord:
    """A records.jsonl line as the probe writes it; ``fields`` say how the request went (default: 200, no image).
    Without an ``invocation`` it is not known which server start sent it, so no request counts as cold."""
    return ProbeRecord.model_validate(
        {
            "fixture_id": fixture_id,
            "seed": seed,
            "n_references": FIXTURES[fixture_id],
            "steps": 4,
            "true_cfg_scale": 1.0,
            "size": f"{SIZE}x{SIZE}",
            "endpoint": "http://127.0.0.1:9000",
            "invocation": None,
            "t_start": None,
            "t_end": None,
            "wall_s": 0.5,
            "http": 200,
            "bytes": None,
            "sha256": None,
            "structure": None,
            "usage": None,
            "metrics": None,
            "error": None,
            "error_code": None,
            "peak_memory_mib": None,
            **fields,
        }
    )


def _image(run: Path, fixture_id: str, seed: int, pixels: np.ndarray) -> dict[str, Any]:
    """Save the PNG; the record fields that describe it."""
    path = run / "images" / f"{fixture_id}.s{seed}.png"
    Image.fromarray(pixels, "RGBA").save(path)
    return {"bytes": path.stat().st_size, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def write_records(run: Path, records: list[ProbeRecord]) -> None:
    with RecordLog(run / "records.jsonl") as log:
        for line in records:
            log.append(line)


def write_run(root: Path, spec: RunSpec, baseline: Path | None = None) -> Path:
    """A probe run directory; with ``baseline``, judged by ``ditq gate`` and compared by ``ditq compare``."""
    run = root / spec.label
    (run / "images").mkdir(parents=True)
    kind = "baseline" if spec.kind == "baseline" else "probe"
    # one server start; a candidate's server says it served the artifact a CANDIDATE.json names (ARTIFACT_DIGEST)
    health = {"status": "ready", "artifact_digest": None if kind == "baseline" else ARTIFACT_DIGEST}
    server = ServerEntry(endpoint="http://127.0.0.1:9000", health=health)
    start = Invocation(
        index=0, started_utc="2026-11-30T12:00:00+00:00", planned=0, retry=None, servers=[server]
    )
    write_model(run / "RUN.json", run_file(kind, [start]))
    records = []
    for fixture_id, refs in FIXTURES.items():
        for index, seed in enumerate(SEEDS):
            if refs in spec.oom_refs:
                fields: dict[str, Any] = {
                    "http": 503,
                    "error": "HTTP 503 out_of_memory: CUDA out of memory",
                    "error_code": "out_of_memory",
                }
            elif refs in spec.fail_refs:
                fields = {"http": 500, "error": "HTTP 500 generation_failed"}
            else:
                pixels = baseline_pixels(fixture_id, seed) if spec.kind == "baseline" else None
                if pixels is None:
                    pixels = candidate_pixels(spec.kind, fixture_id, seed)
                fields = {
                    "wall_s": spec.wall_by_refs[refs] + 0.1 * index,
                    **_image(run, fixture_id, seed, pixels),
                }
            records.append(record(fixture_id, seed, parallel=spec.parallel, **fields))
    write_records(run, records)
    if spec.memory_mib:
        # the probe's sampler format: one row per device and sample; device 1 stays idle
        lines = ["t_unix,device,used_mib,total_mib,process_mib"]
        for i, used in enumerate(spec.memory_mib):
            lines += [f"{1000.0 + i:.3f},0,{used},24576,", f"{1000.0 + i:.3f},1,10,24576,"]
        (run / "vram.csv").write_text("\n".join(lines) + "\n")
    if spec.gate:
        write_model(run / "gate.json", gate_run(run, load_rules()).to_file())
    if spec.compare and baseline is not None:
        band = None if spec.parity_db is None else ParityBand("stated", spec.parity_db, {}, 1.0)
        write_model(run / "compare.json", compare_run(run, baseline, parity=band, use_lpips=False))
    return run


# -- a sweep's offload ladder, as ditq probe and ditq sweep write it ------------------------------------------

GIB = 2**30
LADDER_FIXTURES = {"fx-one": 1, "fx-two": 2}  # fixture id -> reference count (ids shared with FIXTURES)
KERNEL_PATHS = {"triton-w8a8": 196}
MEMORY_CAP = {
    "device": "cuda:0",
    "budget_bytes": 24 * GIB,
    "outside_allocator_bytes": 512 * 2**20,
    "allocator_bytes": 24 * GIB - 512 * 2**20,
    "device_total_bytes": 140 * GIB,
}


@dataclass
class LadderSpec:
    """Which offload mode serves each reference count; the modes before ``loads_from`` do not load the model.

    ``walls[k]`` are the seconds of the requests at k references in the order they ran: the first is the
    server's first request of that shape (cold). ``served_at[k]`` None: out of memory at every mode.
    """

    walls: dict[int, tuple[float, ...]]
    served_at: dict[int, str | None]
    ladder: tuple[str, ...] = ("none", "model", "block")
    loads_from: str = "model"
    peak_mib: dict[str, float] = field(default_factory=lambda: {"model": 15000.0, "block": 9000.0})
    kernel_paths: dict[str, int] = field(default_factory=lambda: dict(KERNEL_PATHS))


def _health(offload: str, kernel_paths: dict[str, int], digest: str | None = None) -> dict:
    return {
        "status": "ready",
        "model": "artifact",
        "artifact_digest": digest,
        "device": "cuda:0",
        "offload": offload,
        "dtype": "bfloat16",
        "max_memory": MEMORY_CAP,
        "load_seconds": 41.5 if offload == "model" else 55.5,
        "kernel_choice_seconds": 6.5,
        "ready_seconds": 44.0 if offload == "model" else 58.0,
        "kernel_paths": kernel_paths,
        "doctor": {"status": "passed", "summary": "196 quantized layers"},
    }


def _attempt(offload: str, status: str, **fields: object) -> Attempt:
    return Attempt.model_validate(
        {"offload": offload, "command": f"ditq serve --offload {offload}", "status": status, **fields}
    )


def _ladder_lines(
    run: Path, spec: LadderSpec, kind: str
) -> tuple[list[ProbeRecord], list[Invocation], list[Attempt]]:
    """(record lines, invocations, attempts), climbing the ladder until nothing runs out of memory."""
    lines, invocations, attempts = [], [], []
    pending = dict(LADDER_FIXTURES)
    clock = 1000.0
    for offload in spec.ladder:
        if spec.ladder.index(offload) < spec.ladder.index(spec.loads_from):
            message = "the server exited with code 3 before it was healthy"
            attempts.append(_attempt(offload, "out_of_memory_at_load", seconds=20.0, message=message))
            continue
        invocation = len(invocations)
        digest = None if kind == "baseline" else ARTIFACT_DIGEST
        server = ServerEntry(
            endpoint="http://127.0.0.1:9000", health=_health(offload, spec.kernel_paths, digest)
        )
        invocations.append(
            Invocation(
                index=invocation,
                started_utc="2026-11-30T12:00:00+00:00",
                planned=0,
                retry="out_of_memory" if invocation else None,
                servers=[server],
            )
        )
        for fixture_id, refs in list(pending.items()):
            for seed, wall in enumerate(spec.walls[refs], start=1):
                fields: dict[str, Any] = {"offload": offload, "invocation": invocation, "t_start": clock}
                clock += 20.0
                if spec.served_at[refs] == offload:
                    pixels = baseline_pixels(fixture_id, seed) if kind == "baseline" else None
                    pixels = candidate_pixels("healthy", fixture_id, seed) if pixels is None else pixels
                    fields.update(wall_s=wall, peak_memory_mib=spec.peak_mib[offload])
                    fields.update(_image(run, fixture_id, seed, pixels))
                else:
                    fields.update(
                        http=503, wall_s=0.5, error="HTTP 503: out of memory", error_code="out_of_memory"
                    )
                lines.append(record(fixture_id, seed, t_end=fields["t_start"] + fields["wall_s"], **fields))
            if spec.served_at[refs] == offload:
                del pending[fixture_id]
        still = sum(len(spec.walls[k]) for k in pending.values())
        attempts.append(
            _attempt(
                offload,
                "ok",
                seconds=90.0,
                ready_s=50.0,
                probe_command=f"ditq {kind} --out {run}",
                exit_code=1 if still else 0,
                out_of_memory_after=still,
            )
        )
        if not pending:
            break
    return lines, invocations, attempts


def write_ladder_run(run: Path, spec: LadderSpec, kind: str = "probe") -> list[Attempt]:
    """A run directory served through an offload ladder (records, RUN.json, vram.csv); returns the attempts."""
    (run / "images").mkdir(parents=True)
    lines, invocations, attempts = _ladder_lines(run, spec, kind)
    memory = MemoryDescription(
        source="nvml",
        interval_s=1.0,
        pid=4242,
        device=0,
        measures="server process (driver count)",
        reason=None,
    )
    write_model(run / "RUN.json", run_file(kind, invocations, memory))
    write_records(run, lines)
    # another process holds more of device 0 than the server does: the peak is the server's own 20000 MiB
    rows = ["t_unix,device,used_mib,total_mib,process_mib"]
    rows += [f"{1000.0 + i},0,{30000 + i},143771,{19998 + i}" for i in range(3)]
    (run / "vram.csv").write_text("\n".join(rows) + "\n")
    return attempts


def write_ladder_candidate(root: Path, name: str, spec: LadderSpec) -> Path:
    """A sweep's candidate directory: CANDIDATE.json (attempts, weight bytes, stage times) and run/."""
    candidate = root / name
    attempts = write_ladder_run(candidate / "run", spec)
    stages = {
        stage: {"status": "ok", "seconds": seconds, "command": f"ditq {stage}", "message": None}
        for stage, seconds in (("quantize", 120.0), ("serve", 150.0), ("probe", 300.0))
    }
    description = {
        "name": name,
        "scheme": "w8a8",
        "artifact": str(candidate / "artifact"),
        "artifact_digest": ARTIFACT_DIGEST,
        "weight_bytes": {"transformer": {"artifact": int(7.26 * GIB), "source": int(13.96 * GIB)}},
        "max_memory": "24GiB",
        "endpoint": None,
        "run": "run",
        "doctor": {"passed": True, "failing": [], "checked": 1, "report": "doctor-reports"},
        "offload": list(spec.ladder),
        "attempts": attempts,
        "stages": stages,
    }
    write_model(candidate / "CANDIDATE.json", CandidateFile.model_validate(description))
    return candidate
