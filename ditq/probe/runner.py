"""The matrix runner: every fixture x seed through one or more image servers, crash-safe.

Work items go through one shared queue; each endpoint gets ``concurrency``
workers, so several replicas drain the same matrix. As each request completes,
its PNG is written atomically to ``RUN/images/FIXTURE.sSEED.png`` and its record
is appended (flushed, fsynced) to ``RUN/records.jsonl``. A rerun skips keys
that already have a record; ``retry_failed`` redoes the ones that failed.
Server faults (timeouts, refused connections, 5xx, bodies without an image)
become records with an ``error``; the run itself never aborts on them, though a
server that stopped answering is waited for first (``ServerWatch``).

What the probe cannot write (a full disk) stops the run: RUN.json says
``failed`` with the reason, and the error is raised. RUN.json says ``complete``
only when every planned request has a record. One probe at a time writes to a
run directory (``LOCK_FILE``).
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import logging
import platform
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal, Protocol

import httpx

from ditq.errors import DitqError, InputError
from ditq.fsutil import RUN, atomic_write_bytes, check_output
from ditq.metrics import structure_metrics_png
from ditq.probe.fixtures import Fixture, fixture_digest, fixture_digests, load_fixtures
from ditq.probe.memory import MemorySampler
from ditq.probe.records import (
    RecordLog,
    image_name,
    is_out_of_memory,
    is_success,
    latest_by_key,
    read_records,
    read_run_file,
    unrecorded,
)
from ditq.probe.server_watch import LOST_CONNECTION, ServerWatch
from ditq.progress import progress_bar
from ditq.runfiles import (
    IMAGES_DIR,
    RECORDS_FILE,
    RUN_FILE,
    HttpOptions,
    InProcessOptions,
    Invocation,
    MemoryDescription,
    ProbeRecord,
    RunCounts,
    RunDescription,
    RunFile,
    ServerEntry,
    Structure,
    write_model,
)

__all__ = [
    "PROBE_API_KEY_ENV",
    "Executor",
    "HttpExecutor",
    "ProbeOptions",
    "ProbeSummary",
    "Reply",
    "describe_run",
    "normalize_endpoint",
    "run_matrix",
    "run_probe",
    "select_fixtures",
    "versions",
]

log = logging.getLogger(__name__)

LOCK_FILE = RUN.bookkeeping[0]  # ".probe.lock" in the run directory, held (flock) while a probe writes there


@dataclass(frozen=True)
class Reply:
    """What an executor got for one request: the record's fields it measures, and the image (None: none)."""

    wall_s: float
    http: int | None  # None: no HTTP answer (in process, a timeout, a refused connection)
    png: bytes | None = None
    usage: dict[str, Any] | None = None
    metrics: dict[str, Any] | None = None
    error: str | None = None
    error_code: str | None = None
    waited_s: float = 0.0  # spent waiting for a server that went away, before the request that was answered


class Executor(Protocol):
    """Makes one image: through an endpoint (``HttpExecutor``) or in process (``ditq.judge.baseline``)."""

    @property
    def endpoint(self) -> str: ...  # a server's base URL, or "in-process"

    @property
    def offload(self) -> str | None: ...  # the serving side's offload mode, where known

    @property
    def parallel(self) -> str | None: ...  # the serving side's --parallel (cp=2); None: one device

    def __call__(self, fixture: Fixture, seed: int) -> Reply: ...


PROBE_API_KEY_ENV = "DITQ_PROBE_API_KEY"  # the key the harness sends (ditq serve's own is DITQ_API_KEY)


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
    server_wait_s: float = 60.0  # how long a server that stopped answering is waited for (ServerWatch)
    model: str | None = None  # the ``model`` field sent with each request
    only: list[str] | None = None  # fixture ids; None = all
    memory_interval_s: float = 1.0
    server_pid: int | None = None
    progress: bool = True
    kind: Literal["probe", "baseline"] = "probe"  # what RUN.json says this run is
    model_dir: Path | None = None  # the model the server serves, recorded in RUN.json (a baseline's)
    api_key: str | None = field(
        default=None, repr=False
    )  # sent as 'Authorization: Bearer KEY'; never recorded


@dataclass
class ProbeSummary:
    run: Path
    planned: int
    skipped: int
    memory: MemoryDescription
    completed: int = 0
    failed: int = 0
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


def server_facts(endpoint: str, timeout_s: float = 10.0) -> ServerEntry:
    """What the server says about itself on GET /health (ditq serve: device, offload, memory budget, load
    time, kernel paths, doctor); the body is None when it says nothing readable (another server, say)."""
    try:
        response = httpx.get(f"{endpoint}/health", timeout=timeout_s)
        body = response.json()
    except (httpx.HTTPError, ValueError):
        body = None
    return ServerEntry(endpoint=endpoint, health=body if isinstance(body, dict) else None)


def _error_code(response: httpx.Response) -> str | None:
    """The ``code`` of an OpenAI error envelope, if the body is one."""
    try:
        code = response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None
    return code if isinstance(code, str) else None


class HttpExecutor:
    """One OpenAI-compatible images endpoint: edits (multipart, ``image[]``) or generations (JSON)."""

    def __init__(self, server: ServerEntry, options: ProbeOptions, watch: ServerWatch) -> None:
        self.endpoint = server.endpoint
        self.watch = watch  # shared by the endpoint's workers
        self.options = options
        facts = server.facts
        self.offload = None if facts is None else facts.offload
        self.parallel = None if facts is None or facts.parallel is None else facts.parallel.label
        headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else None
        self.client = httpx.Client(
            timeout=httpx.Timeout(options.timeout_s, connect=min(30.0, options.timeout_s)), headers=headers
        )

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

    def __call__(self, fixture: Fixture, seed: int) -> Reply:
        """The server's reply; a lost connection waits for the server (``ServerWatch``) and is sent once more
        when it is back, or recorded as failed, saying how long it waited."""
        t0 = time.perf_counter()
        try:
            reply = self._send(fixture, seed)
        except LOST_CONNECTION as error:
            lost = error
        else:
            self.watch.answered()
            return reply
        gone = self.watch.wait_for_return()
        if gone is None:
            resent = time.perf_counter()
            try:
                reply = self._send(fixture, seed)
            except LOST_CONNECTION as error:
                lost, gone = error, "lost again after the server answered /health"
            else:
                self.watch.answered()
                return replace(reply, waited_s=round(resent - t0, 3))
        wall_s = round(time.perf_counter() - t0, 3)  # the wait included
        return Reply(wall_s, None, error=f"{type(lost).__name__}: {lost}; {gone}")

    def _send(self, fixture: Fixture, seed: int) -> Reply:
        """One request; a lost connection (``LOST_CONNECTION``) is raised, every other fault is a Reply."""
        t0 = time.perf_counter()
        try:
            response = self._post(fixture, seed)
        except LOST_CONNECTION:
            raise
        except httpx.TimeoutException as error:
            error_text = f"timeout after {self.options.timeout_s:g} s ({type(error).__name__})"
            return Reply(round(time.perf_counter() - t0, 3), None, error=error_text)
        except httpx.HTTPError as error:
            return Reply(round(time.perf_counter() - t0, 3), None, error=f"{type(error).__name__}: {error}")
        wall_s = round(time.perf_counter() - t0, 3)
        if response.status_code != 200:
            error_text = f"HTTP {response.status_code}: {response.text[:500]}"
            return Reply(wall_s, response.status_code, error=error_text, error_code=_error_code(response))
        try:
            body = response.json()
            png = base64.b64decode(body["data"][0]["b64_json"], validate=True)
        except (ValueError, KeyError, IndexError, TypeError) as error:
            error_text = f"HTTP 200 without a decodable image ({type(error).__name__}: {error})"
            return Reply(wall_s, 200, error=error_text)
        metrics = body.get("metrics")
        extra = {k: body[k] for k in ("stage_metrics", "timings") if body.get(k)}
        merged = {**(metrics or {}), **extra} if (metrics or extra) else None
        return Reply(wall_s, 200, png, usage=body.get("usage"), metrics=merged)

    def close(self) -> None:
        self.client.close()


def _image_fields(reply: Reply, run: Path, fixture_id: str, seed: int) -> dict[str, Any]:
    """bytes, sha256, structure and error: from the PNG (written atomically first), or the reply's error."""
    failed = {"bytes": None, "sha256": None, "structure": None, "error": reply.error}
    if reply.png is None or reply.error:
        return failed
    try:
        structure = Structure.model_validate(structure_metrics_png(reply.png))
    except Exception as error:  # undecodable bytes are a server fault, recorded
        return {**failed, "error": f"response image cannot be decoded ({type(error).__name__}: {error})"}
    path = run / IMAGES_DIR / image_name(fixture_id, seed)
    try:
        atomic_write_bytes(path, reply.png)
    except OSError as error:
        raise DitqError(f"{path}: cannot write the image ({error.strerror or error})") from error
    return {
        "bytes": len(reply.png),
        "sha256": hashlib.sha256(reply.png).hexdigest(),
        "structure": structure,
        "error": None,
    }


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


def _check_resume(path: Path, previous: RunFile | None, description: RunDescription) -> None:
    if previous is None:
        return
    settings = (
        ("steps", previous.steps, description.steps),
        ("true_cfg_scale", previous.true_cfg_scale, description.true_cfg_scale),
    )
    for key, before, now in settings:
        if before != now:
            raise InputError(
                f"{path}: this run was made with {key}={before!r}, not {now!r}; use a new --out directory"
            )
    before_digests, now_digests = previous.fixture_digests, description.fixture_digests
    for fixture_id in sorted(before_digests.keys() & now_digests.keys()):
        if before_digests[fixture_id] != now_digests[fixture_id]:
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
        description: RunDescription,
        invocations: list[Invocation],
        progress: bool,
    ) -> None:
        self.run, self.summary, self.sampler, self.description = run, summary, sampler, description
        self.invocations = invocations  # the earlier ones and this one, last
        self.jobs: queue.Queue[tuple[Fixture, int]] = queue.Queue()
        for job in todo:
            self.jobs.put(job)
        self.bar = progress_bar(len(todo), run.name, "img", enabled=progress)
        self.lock = threading.Lock()
        self.stopping = threading.Event()  # set on Ctrl-C or a failure: no new jobs; resume redoes the rest
        self.failure: Exception | None = None  # the first error a worker stopped on
        self.other_failures: list[ProbeRecord] = []  # failed records that did not run out of memory
        self.started = datetime.now(timezone.utc).isoformat(timespec="seconds")

    def one(self, executor: Executor, fixture: Fixture, seed: int) -> ProbeRecord:
        t_start = round(time.time(), 3)
        self.sampler.sample_now()  # window edges get a sample of their own, however short the request
        reply = executor(fixture, seed)
        self.sampler.sample_now()
        t_end = round(time.time(), 3)
        waited: dict[str, Any] = (
            {"waited_s": reply.waited_s} if reply.waited_s else {}
        )  # written only where waited
        return ProbeRecord(
            fixture_id=fixture.id,
            seed=seed,
            n_references=len(fixture.references),
            steps=self.description.steps,
            true_cfg_scale=self.description.true_cfg_scale,
            size=fixture.size,
            endpoint=executor.endpoint,
            offload=executor.offload,
            parallel=executor.parallel,
            invocation=self.invocations[-1].index,
            t_start=t_start,
            t_end=t_end,
            wall_s=reply.wall_s,
            **waited,
            http=reply.http,
            usage=reply.usage,
            metrics=reply.metrics,
            error_code=reply.error_code,
            peak_memory_mib=self.sampler.peak_between(t_start, t_end),
            **_image_fields(reply, self.run, fixture.id, seed),
        )

    def work(self, executor: Executor, log_file: RecordLog) -> None:
        """Drain the queue. The first error (a record or image that cannot be written: a full disk) stops every
        worker and fails the run; the requests it leaves are done by a rerun."""
        try:
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
                    if not is_success(record) and not is_out_of_memory(record):
                        self.other_failures.append(record)
                    self.bar.set_postfix(failed=self.summary.failed, refresh=False)
                    self.bar.update(1)
        except Exception as error:
            with self.lock:
                self.failure = self.failure or error
            self.stopping.set()

    def finish(self) -> None:
        """RUN.json's last word on this invocation, then the failure, if any, raised. Complete only when every
        planned request has a record in records.jsonl as it reads back."""
        if self.failure is None and not self.stopping.is_set():
            missing = unrecorded(self.description, read_records(self.run))
            if missing:
                fixture_id, seed = missing[0]
                self.failure = DitqError(
                    f"{self.run / RECORDS_FILE}: {len(missing)} planned requests have no record "
                    f"(first: {fixture_id} s{seed})"
                )
            elif self.summary.completed and len(self.other_failures) == self.summary.completed:
                # not one image and not one out-of-memory answer (which is a capacity finding): the server
                # refused or broke on everything (401, 5xx, no connection), so the run holds no evidence
                first = self.other_failures[0]
                said = f"HTTP {first.http}" if first.http is not None else "no answer"
                self.failure = DitqError(
                    f"{self.run}: every one of the {self.summary.completed} requests failed (first: "
                    f"{first.fixture_id} s{first.seed}, {said}: {(first.error or '')[:120]})"
                )
        status: Literal["interrupted", "failed", "complete"] = (
            "failed" if self.failure else "interrupted" if self.stopping.is_set() else "complete"
        )
        try:
            self.write_run_json(status)
        except OSError as error:
            raise DitqError(
                f"{self.run / RUN_FILE}: cannot write ({error.strerror or error}), so it still says 'running'"
                + (f"; the run stopped on: {self.failure}" if self.failure else "")
            ) from error
        if isinstance(self.failure, DitqError):
            raise DitqError(
                f"{self.failure}; the run stopped and RUN.json says 'failed'; rerun the same command to "
                "resume once that is fixed"
            ) from self.failure
        if self.failure is not None:
            raise self.failure

    def write_run_json(self, status: Literal["running", "interrupted", "failed", "complete"]) -> None:
        summary = self.summary
        finished: dict[str, Any] = (
            {}
            if status == "running"
            else {
                "finished_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "peak_memory_mib": summary.peak_memory_mib,
                "counts": RunCounts(
                    planned=summary.planned,
                    skipped=summary.skipped,
                    completed=summary.completed,
                    failed=summary.failed,
                ),
            }
        )
        if self.failure is not None:
            finished["failure"] = str(self.failure)
        run_file = RunFile.of(
            self.description,
            invocations=self.invocations,
            memory=summary.memory,
            started_utc=self.started,
            status=status,
            **finished,
        )
        write_model(self.run / RUN_FILE, run_file)


@contextlib.contextmanager
def _exclusive(run: Path) -> Iterator[None]:
    """Hold the run directory's lock for the invocation: two probes on one directory would both do (and append)
    every request. The lock goes with the process, however it ends."""
    try:
        handle = open(run / LOCK_FILE, "a")  # noqa: SIM115 - closed below, which releases the lock
    except OSError as error:
        raise DitqError(
            f"{run / LOCK_FILE}: cannot open the run's lock ({error.strerror or error})"
        ) from error
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise InputError(
                f"{run}: another probe is writing to this run directory; wait for it, or choose another --out"
            ) from None
        yield


def run_matrix(
    run: Path,
    fixtures: dict[str, Fixture],
    seeds: Sequence[int],
    executors: Sequence[Executor],
    description: RunDescription,
    *,
    retry_failed: bool = False,
    retry_out_of_memory: bool = False,
    memory_interval_s: float = 1.0,
    server_pid: int | None = None,
    servers: Sequence[ServerEntry] = (),
    progress: bool = True,
) -> ProbeSummary:
    """Drain fixtures x seeds through ``executors`` (one worker each), appending records to ``run``.

    Each call is one *invocation* of the run directory, listed in RUN.json with the servers it talked to
    (``servers``: endpoint and what /health said) and stamped on the records it wrote.
    """
    inputs = [Path(description.fixtures_file), Path(description.refs_dir)]
    check_output(
        run, RUN, [*inputs, *([Path(description.model)] if description.model else [])], replace=False
    )
    run.mkdir(parents=True, exist_ok=True)
    with _exclusive(run):
        previous = read_run_file(run)
        _check_resume(run / RUN_FILE, previous, description)
        for leftover in (run / IMAGES_DIR).glob(".ditq-tmp-*"):  # half-written images of a killed run
            leftover.unlink()
        # opened before the plan reads the records: its repair of a last line decides what counts as done
        with RecordLog(run / RECORDS_FILE) as log_file:
            todo, skipped = _plan(fixtures, seeds, run, retry_failed, retry_out_of_memory)
            earlier = [] if previous is None else previous.invocations
            invocation = Invocation(
                index=len(earlier),
                started_utc=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                planned=len(todo),
                retry="failed" if retry_failed else "out_of_memory" if retry_out_of_memory else None,
                servers=list(servers),
            )
            device = next((s.cuda_index for s in servers if s.cuda_index is not None), None)
            sampler = MemorySampler(run / "vram.csv", memory_interval_s, server_pid, device).start()
            summary = ProbeSummary(
                run=run, planned=len(todo) + skipped, skipped=skipped, memory=sampler.describe()
            )
            matrix = _Matrix(run, todo, summary, sampler, description, [*earlier, invocation], progress)
            matrix.write_run_json("running")
            threads = [
                threading.Thread(target=matrix.work, args=(e, log_file), daemon=True) for e in executors
            ]
            try:
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
                matrix.finish()
    return summary


def describe_run(
    kind: Literal["probe", "baseline"],
    endpoints: list[str],
    fixtures_file: Path,
    refs: Path,
    fixtures: dict[str, Fixture],
    seeds: list[int],
    steps: int,
    true_cfg_scale: float,
    options: HttpOptions | InProcessOptions,
    model_dir: Path | None = None,
) -> RunDescription:
    """RUN.json's description: what was run, against what, with which fixtures (digested) and versions."""
    return RunDescription(
        schema="ditq-run-v1",
        kind=kind,
        **({} if model_dir is None else {"model": str(model_dir)}),
        endpoints=endpoints,
        fixtures_file=str(fixtures_file),
        fixture_ids=list(fixtures),
        fixture_digest=fixture_digest(fixtures),
        fixture_digests=fixture_digests(fixtures),
        refs_dir=str(refs),
        seeds=list(seeds),
        steps=steps,
        true_cfg_scale=true_cfg_scale,
        options=options,
        versions=versions(),
    )


def select_fixtures(fixtures: dict[str, Fixture], only: Sequence[str] | None) -> dict[str, Fixture]:
    """``--only``: those fixtures (all when None); an unknown id is an InputError naming it."""
    if not only:
        return fixtures
    unknown = [f for f in only if f not in fixtures]
    if unknown:
        raise InputError(f"--only: unknown fixture {unknown[0]!r} (known: {', '.join(fixtures)})")
    return {k: v for k, v in fixtures.items() if k in only}


def run_probe(options: ProbeOptions) -> ProbeSummary:
    """The ``ditq probe`` job: fixtures x seeds against the endpoints, into ``options.out``."""
    if options.concurrency < 1:
        raise InputError(f"--concurrency must be at least 1, got {options.concurrency}")
    if not options.endpoints:
        raise InputError("--endpoint: give at least one URL")
    if options.server_wait_s < 0:
        raise InputError(f"--server-wait must be 0 or more seconds, got {options.server_wait_s:g}")
    endpoints = [normalize_endpoint(e) for e in options.endpoints]
    fixtures = select_fixtures(load_fixtures(options.fixtures, options.refs), options.only)
    description = describe_run(
        options.kind,
        endpoints,
        options.fixtures,
        options.refs,
        fixtures,
        options.seeds,
        options.steps,
        options.true_cfg_scale,
        HttpOptions(concurrency=options.concurrency, timeout_s=options.timeout_s, model=options.model),
        options.model_dir,
    )
    servers = [server_facts(endpoint) for endpoint in endpoints]
    watches = {server.endpoint: ServerWatch(server.endpoint, options.server_wait_s) for server in servers}
    executors = [
        HttpExecutor(server, options, watches[server.endpoint])
        for server in servers
        for _ in range(options.concurrency)
    ]
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
