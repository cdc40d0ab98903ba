"""The matrix runner: every fixture x seed through one or more image servers, crash-safe.

Work items go through one shared queue; each endpoint gets ``concurrency``
workers, so several replicas drain the same matrix. As each request completes,
its PNG is written atomically to ``RUN/images/FIXTURE.sSEED.png`` and its record
is appended (flushed, fsynced) to ``RUN/records.jsonl``. A rerun skips keys
that already have a record; ``retry_failed`` redoes the ones that failed.
Server faults (timeouts, refused connections, 5xx, bodies without an image)
become records with an ``error``; the run itself never aborts on them.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import platform
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from ditq.errors import InputError
from ditq.fsutil import atomic_write_bytes, atomic_write_json
from ditq.metrics import structure_metrics_png
from ditq.probe.fixtures import Fixture, fixture_digest, fixture_digests, load_fixtures
from ditq.probe.memory import MemorySampler
from ditq.probe.records import (
    IMAGES_DIR,
    RECORDS_FILE,
    RUN_FILE,
    RecordLog,
    image_name,
    is_out_of_memory,
    is_success,
    latest_by_key,
    read_records,
)

__all__ = [
    "Executor",
    "HttpExecutor",
    "ProbeOptions",
    "ProbeSummary",
    "describe_run",
    "normalize_endpoint",
    "run_matrix",
    "run_probe",
    "versions",
]

log = logging.getLogger(__name__)

# (fixture, seed) -> (record fields: wall_s, http, usage, metrics, error; PNG bytes or None)
Executor = Callable[[Fixture, int], tuple[dict[str, Any], bytes | None]]


@dataclass
class ProbeOptions:
    endpoints: list[str]
    fixtures: Path
    refs: Path
    seeds: list[int]
    out: Path
    steps: int = 20
    true_cfg_scale: float = 1.0
    concurrency: int = 1  # in-flight requests per endpoint
    retry_failed: bool = False
    retry_out_of_memory: bool = False  # redo only the requests that ran out of accelerator memory
    timeout_s: float = 1800.0
    model: str | None = None
    only: list[str] | None = None  # fixture ids; None = all
    memory_interval_s: float = 1.0
    server_pid: int | None = None
    progress: bool = True
    kind: str = "probe"  # what RUN.json says this run is ("probe" or "baseline")
    extra: dict[str, Any] = field(default_factory=dict)  # more facts for RUN.json (e.g. the model path)


@dataclass
class ProbeSummary:
    run: Path
    planned: int
    skipped: int
    completed: int = 0
    failed: int = 0
    memory: dict[str, Any] = field(default_factory=dict)
    peak_memory_mib: float | None = None


def versions() -> dict[str, str]:
    import numpy
    import PIL

    import ditq

    return {
        "ditq": getattr(ditq, "__version__", "unknown"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "httpx": httpx.__version__,
        "numpy": numpy.__version__,
        "pillow": PIL.__version__,
    }


def normalize_endpoint(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise InputError(f"--endpoint: {url!r} is not an http(s) URL")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def server_facts(endpoint: str, timeout_s: float = 10.0) -> dict[str, Any] | None:
    """What the server says about itself on GET /health (ditq serve: device, offload, memory budget, load
    time, kernel paths, doctor), or None when it says nothing readable (another server, say)."""
    try:
        response = httpx.get(f"{endpoint}/health", timeout=timeout_s)
        body = response.json()
    except (httpx.HTTPError, ValueError):
        return None
    return body if isinstance(body, dict) else None


def _error_code(response: httpx.Response) -> str | None:
    """The ``code`` of an OpenAI error envelope, if the body is one."""
    try:
        code = response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None
    return code if isinstance(code, str) else None


class HttpExecutor:
    """One OpenAI-compatible images endpoint: edits (multipart, ``image[]``) or generations (JSON)."""

    def __init__(self, endpoint: str, options: ProbeOptions, server: dict[str, Any] | None = None) -> None:
        self.endpoint = endpoint
        self.options = options
        self.server = server or {}
        self.client = httpx.Client(
            timeout=httpx.Timeout(options.timeout_s, connect=min(30.0, options.timeout_s))
        )

    @property
    def offload(self) -> str | None:
        offload = self.server.get("offload")
        return offload if isinstance(offload, str) else None

    def _fields(self, fixture: Fixture, seed: int) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "prompt": fixture.prompt,
            "seed": seed,
            "num_inference_steps": self.options.steps,
            "true_cfg_scale": self.options.true_cfg_scale,
            "size": fixture.size,
            "n": 1,
            "response_format": "b64_json",
            "output_format": "png",
            "return_stage_metrics": True,
        }
        if self.options.model:
            fields["model"] = self.options.model
        if fixture.negative_prompt:
            fields["negative_prompt"] = fixture.negative_prompt
        return fields

    def _post(self, fixture: Fixture, seed: int) -> httpx.Response:
        fields = self._fields(fixture, seed)
        if fixture.mode == "generate":
            return self.client.post(f"{self.endpoint}/v1/images/generations", json=fields)
        form = {k: (str(v).lower() if isinstance(v, bool) else str(v)) for k, v in fields.items()}
        files = [("image[]", (p.name, p.read_bytes(), "image/png")) for p in fixture.reference_paths]
        return self.client.post(f"{self.endpoint}/v1/images/edits", data=form, files=files)

    def __call__(self, fixture: Fixture, seed: int) -> tuple[dict[str, Any], bytes | None]:
        t0 = time.perf_counter()
        fields: dict[str, Any] = {"http": None}
        try:
            response = self._post(fixture, seed)
        except httpx.TimeoutException as error:
            fields["error"] = f"timeout after {self.options.timeout_s:g} s ({type(error).__name__})"
            return {"wall_s": round(time.perf_counter() - t0, 3), **fields}, None
        except httpx.HTTPError as error:
            fields["error"] = f"{type(error).__name__}: {error}"
            return {"wall_s": round(time.perf_counter() - t0, 3), **fields}, None
        fields["wall_s"] = round(time.perf_counter() - t0, 3)
        fields["http"] = response.status_code
        if response.status_code != 200:
            fields["error"] = f"HTTP {response.status_code}: {response.text[:500]}"
            fields["error_code"] = _error_code(response)
            return fields, None
        try:
            body = response.json()
            png = base64.b64decode(body["data"][0]["b64_json"], validate=True)
        except (ValueError, KeyError, IndexError, TypeError) as error:
            fields["error"] = f"HTTP 200 without a decodable image ({type(error).__name__}: {error})"
            return fields, None
        fields["usage"] = body.get("usage")
        metrics = body.get("metrics")
        extra = {k: body[k] for k in ("stage_metrics", "timings") if body.get(k)}
        fields["metrics"] = {**(metrics or {}), **extra} if (metrics or extra) else None
        return fields, png

    def close(self) -> None:
        self.client.close()


def _base_record(fixture: Fixture, seed: int, steps: int, cfg: float) -> dict[str, Any]:
    return {
        "fixture_id": fixture.id,
        "seed": seed,
        "n_references": len(fixture.references),
        "steps": steps,
        "true_cfg_scale": cfg,
        "size": fixture.size,
    }


def _finish_record(record: dict[str, Any], png: bytes | None, run: Path) -> dict[str, Any]:
    """Fill bytes/sha256/structure from the PNG (written atomically first) or keep the error."""
    if png is not None and not record.get("error"):
        try:
            record["structure"] = structure_metrics_png(png)
        except Exception as error:  # undecodable bytes are a server fault, recorded
            record["error"] = f"response image cannot be decoded ({type(error).__name__}: {error})"
        else:
            atomic_write_bytes(run / IMAGES_DIR / image_name(record["fixture_id"], record["seed"]), png)
            record["bytes"] = len(png)
            record["sha256"] = hashlib.sha256(png).hexdigest()
    record.setdefault("bytes", None)
    record.setdefault("sha256", None)
    record.setdefault("structure", None)
    record.setdefault("usage", None)
    record.setdefault("metrics", None)
    record.setdefault("error", None)
    record.setdefault("error_code", None)
    return record


def _plan(
    fixtures: dict[str, Fixture],
    seeds: Sequence[int],
    run: Path,
    retry_failed: bool,
    retry_out_of_memory: bool = False,
) -> tuple[list[tuple[Fixture, int]], int]:
    done = latest_by_key(read_records(run)) if (run / RECORDS_FILE).exists() else {}
    todo, skipped = [], 0
    for fixture in fixtures.values():
        for seed in seeds:
            previous = done.get((fixture.id, seed))
            if previous is not None and (
                is_success(previous)
                or not (retry_failed or (retry_out_of_memory and is_out_of_memory(previous)))
            ):
                skipped += 1
                continue
            todo.append((fixture, seed))
    return todo, skipped


def _check_resume(run: Path, description: dict[str, Any]) -> None:
    path = run / RUN_FILE
    if not path.exists():
        return
    previous = json.loads(path.read_text())
    for key in ("steps", "true_cfg_scale"):
        if previous.get(key) != description[key]:
            raise InputError(
                f"{path}: this run was made with {key}={previous.get(key)!r}, not {description[key]!r}; "
                "use a new --out directory"
            )
    before, now = previous.get("fixture_digests") or {}, description["fixture_digests"]
    for fixture_id in sorted(before.keys() & now.keys()):
        if before[fixture_id] != now[fixture_id]:
            raise InputError(
                f"{path}: fixture {fixture_id!r} changed (prompt, size or reference images) since this run "
                "began; use a new --out directory"
            )


class _Matrix:
    """One invocation over a run directory: the shared queue, the workers, the counts and the sampler."""

    def __init__(
        self,
        run: Path,
        todo: list[tuple[Fixture, int]],
        summary: ProbeSummary,
        sampler: MemorySampler,
        description: dict[str, Any],
        progress: bool,
    ) -> None:
        self.run, self.summary, self.sampler, self.description = run, summary, sampler, description
        self.jobs: queue.Queue[tuple[Fixture, int]] = queue.Queue()
        for job in todo:
            self.jobs.put(job)
        self.bar = tqdm(total=len(todo), disable=not progress, unit="img", desc=run.name, dynamic_ncols=True)
        self.lock = threading.Lock()
        self.stopping = threading.Event()  # set on Ctrl-C: no new jobs; in-flight ones are redone on resume
        self.started = datetime.now(timezone.utc).isoformat(timespec="seconds")
        self.invocation = 0

    def one(self, executor: Executor, fixture: Fixture, seed: int) -> dict[str, Any]:
        record = _base_record(fixture, seed, self.description["steps"], self.description["true_cfg_scale"])
        record["endpoint"] = getattr(executor, "endpoint", None)
        record["offload"] = getattr(executor, "offload", None)
        record["invocation"] = self.invocation
        record["t_start"] = round(time.time(), 3)
        self.sampler.sample_now()  # window edges get a sample of their own, however short the request
        fields, png = executor(fixture, seed)
        self.sampler.sample_now()
        record["t_end"] = round(time.time(), 3)
        record.update(fields)
        record["peak_memory_mib"] = self.sampler.peak_between(record["t_start"], record["t_end"])
        return _finish_record(record, png, self.run)

    def work(self, executor: Executor, log_file: RecordLog) -> None:
        while not self.stopping.is_set():
            try:
                fixture, seed = self.jobs.get_nowait()
            except queue.Empty:
                return
            record = self.one(executor, fixture, seed)
            try:
                log_file.append(record)
            except ValueError:  # the log was closed by an interrupt; resume redoes this request
                return
            with self.lock:
                self.summary.completed += 1
                self.summary.failed += 0 if is_success(record) else 1
                self.bar.set_postfix(failed=self.summary.failed, refresh=False)
                self.bar.update(1)

    def write_run_json(self, status: str) -> None:
        counts = {
            k: v
            for k, v in asdict(self.summary).items()
            if k in ("planned", "skipped", "completed", "failed")
        }
        extra = (
            {}
            if status == "running"
            else {
                "finished_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "peak_memory_mib": self.summary.peak_memory_mib,
                "counts": counts,
            }
        )
        atomic_write_json(
            self.run / RUN_FILE,
            {
                **self.description,
                "memory": self.summary.memory,
                "started_utc": self.started,
                "status": status,
                **extra,
            },
        )


def run_matrix(
    run: Path,
    fixtures: dict[str, Fixture],
    seeds: Sequence[int],
    executors: Sequence[Executor],
    description: dict[str, Any],
    *,
    retry_failed: bool = False,
    retry_out_of_memory: bool = False,
    memory_interval_s: float = 1.0,
    server_pid: int | None = None,
    servers: Sequence[dict[str, Any]] = (),
    progress: bool = True,
) -> ProbeSummary:
    """Drain fixtures x seeds through ``executors`` (one worker each), appending records to ``run``.

    Each call is one *invocation* of the run directory, listed in RUN.json with the servers it talked to
    (``servers``: endpoint and what /health said) and stamped on the records it wrote.
    """
    run.mkdir(parents=True, exist_ok=True)
    _check_resume(run, description)
    for leftover in (run / IMAGES_DIR).glob(".ditq-tmp-*"):  # half-written images of a killed run
        leftover.unlink()
    todo, skipped = _plan(fixtures, seeds, run, retry_failed, retry_out_of_memory)
    summary = ProbeSummary(run=run, planned=len(todo) + skipped, skipped=skipped)
    earlier = (
        json.loads((run / RUN_FILE).read_text()).get("invocations", []) if (run / RUN_FILE).exists() else []
    )
    index = len(earlier)
    invocation = {
        "index": index,
        "started_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "planned": len(todo),
        "retry": "failed" if retry_failed else "out_of_memory" if retry_out_of_memory else None,
        "servers": list(servers),
    }
    description = {**description, "invocations": [*earlier, invocation]}
    sampler = MemorySampler(run / "vram.csv", memory_interval_s, server_pid, _device_index(servers)).start()
    summary.memory = sampler.describe()
    matrix = _Matrix(run, todo, summary, sampler, description, progress)
    matrix.invocation = index
    matrix.write_run_json("running")
    try:
        with RecordLog(run / RECORDS_FILE) as log_file:
            threads = [
                threading.Thread(target=matrix.work, args=(e, log_file), daemon=True) for e in executors
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                while thread.is_alive():  # short joins keep Ctrl-C responsive
                    thread.join(timeout=0.2)
    except BaseException:
        matrix.stopping.set()
        raise
    finally:
        matrix.bar.close()
        sampler.stop()
        summary.peak_memory_mib = sampler.peak()
        summary.memory = sampler.describe()
        matrix.write_run_json("interrupted" if matrix.stopping.is_set() else "complete")
    return summary


def _device_index(servers: Sequence[dict[str, Any]]) -> int | None:
    """The CUDA index the (first) server says it runs on ("cuda:1" -> 1), for the memory sampler."""
    for server in servers:
        device = str((server.get("health") or {}).get("device") or "")
        if device.startswith("cuda:") and device[5:].isdigit():
            return int(device[5:])
    return None


def describe_run(
    kind: str,
    endpoints: list[str],
    fixtures_file: Path,
    refs: Path,
    fixtures: dict[str, Fixture],
    seeds: list[int],
    steps: int,
    true_cfg_scale: float,
    options: dict[str, Any],
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """RUN.json: what was run, against what, with which fixtures (digested) and versions."""
    return {
        "schema": "ditq-run-v1",
        "kind": kind,
        **(extra or {}),
        "endpoints": endpoints,
        "fixtures_file": str(fixtures_file),
        "fixture_ids": list(fixtures),
        "fixture_digest": fixture_digest(fixtures),
        "fixture_digests": fixture_digests(fixtures),
        "refs_dir": str(refs),
        "seeds": list(seeds),
        "steps": steps,
        "true_cfg_scale": true_cfg_scale,
        "options": options,
        "versions": versions(),
    }


def run_probe(options: ProbeOptions) -> ProbeSummary:
    """The ``ditq probe`` job: fixtures x seeds against the endpoints, into ``options.out``."""
    if options.concurrency < 1:
        raise InputError(f"--concurrency must be at least 1, got {options.concurrency}")
    if not options.endpoints:
        raise InputError("--endpoint: give at least one URL")
    endpoints = [normalize_endpoint(e) for e in options.endpoints]
    fixtures = load_fixtures(options.fixtures, options.refs)
    if options.only:
        unknown = [f for f in options.only if f not in fixtures]
        if unknown:
            raise InputError(f"--only: unknown fixture {unknown[0]!r} (known: {', '.join(fixtures)})")
        fixtures = {k: v for k, v in fixtures.items() if k in options.only}
    description = describe_run(
        options.kind,
        endpoints,
        options.fixtures,
        options.refs,
        fixtures,
        options.seeds,
        options.steps,
        options.true_cfg_scale,
        {
            "concurrency": options.concurrency,
            "timeout_s": options.timeout_s,
            "model": options.model,
        },
        options.extra,
    )
    facts = {endpoint: server_facts(endpoint) for endpoint in endpoints}
    servers = [{"endpoint": endpoint, "health": health} for endpoint, health in facts.items()]
    executors = [HttpExecutor(e, options, facts[e]) for e in endpoints for _ in range(options.concurrency)]
    try:
        return run_matrix(
            Path(options.out),
            fixtures,
            options.seeds,
            executors,
            description,
            retry_failed=options.retry_failed,
            retry_out_of_memory=options.retry_out_of_memory,
            memory_interval_s=options.memory_interval_s,
            server_pid=options.server_pid,
            servers=servers,
            progress=options.progress,
        )
    finally:
        for executor in executors:
            executor.close()
