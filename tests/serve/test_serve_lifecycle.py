"""The worker's queue (FIFO, drop on withdrawal, out-of-memory recovery) and SIGTERM draining."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import torch
from serve_testkit import FAST, GatedAdapter, LiveServer, make_app, raise_once, tiny_adapter, transformer_hook

from ditq.runtime.adapter import GenerationRequest
from ditq.serve.worker import Cancelled, GenerationWorker, OutOfMemory, QueueClosed, QueueFull
from ditq.sweep.health import wait_healthy

HERE = Path(__file__).resolve().parent
SMALL = {"num_inference_steps": 1, "width": 32, "height": 32, "seed": 0}


def test_withdrawn_queued_job_never_runs_and_the_rest_keep_order() -> None:
    gated = GatedAdapter(tiny_adapter())
    worker = GenerationWorker(gated, max_queue=3)  # type: ignore[arg-type]
    try:
        jobs = [worker.submit(GenerationRequest(prompt="p0", **SMALL))]
        assert gated.entered.acquire(timeout=30)  # p0 runs; p1..p3 fill the queue
        jobs += [worker.submit(GenerationRequest(prompt=f"p{i}", **SMALL)) for i in range(1, 4)]
        with pytest.raises(QueueFull):
            worker.submit(GenerationRequest(prompt="p4", **SMALL))
        assert worker.cancel(jobs[2]) is True  # queued: dropped
        assert worker.cancel(jobs[0]) is False  # running: stopped at its next step
        gated.release.set()
        with pytest.raises(Cancelled) as stopped:
            jobs[0].future.result(timeout=60)
        assert stopped.value.reason == "client_gone" and stopped.value.steps_done == 1
        for job in (jobs[1], jobs[3]):
            assert len(job.future.result(timeout=60).images) == 1
        assert isinstance(jobs[2].future.exception(), Cancelled)
        assert gated.prompts == ["p0", "p1", "p3"]
        assert (worker.dropped, worker.stopped) == (1, 1)
    finally:
        gated.release.set()
        assert worker.close(60)
    with pytest.raises(QueueClosed):
        worker.submit(GenerationRequest(prompt="late", **SMALL))


def test_out_of_memory_is_reported_counted_and_the_worker_goes_on() -> None:
    adapter = tiny_adapter()
    worker = GenerationWorker(adapter, max_queue=2)
    try:
        with transformer_hook(adapter, raise_once(torch.OutOfMemoryError("CUDA out of memory"))):
            failed = worker.submit(GenerationRequest(prompt="big", **SMALL))
            served = worker.submit(GenerationRequest(prompt="next", **SMALL))
            with pytest.raises(OutOfMemory):
                failed.future.result(timeout=60)
            assert len(served.future.result(timeout=60).images) == 1
        assert worker.oom_count == 1
    finally:
        assert worker.close(60)


def test_between_jobs_runs_after_each_finished_job_before_the_next_starts() -> None:
    """What a CUDA server empties the allocator's cache with: after every job that ended (a job out of memory frees
    everything instead), each before the next job's request reaches the adapter."""
    gated = GatedAdapter(tiny_adapter())
    gated.release.set()
    seen: list[list[str]] = []  # the requests the adapter had been given at each call
    worker = GenerationWorker(
        gated,  # type: ignore[arg-type]
        max_queue=4,
        between_jobs=lambda: seen.append(list(gated.prompts)),
    )
    try:
        with transformer_hook(gated.adapter, raise_once(torch.OutOfMemoryError("CUDA out of memory"))):
            jobs = [worker.submit(GenerationRequest(prompt=f"p{i}", **SMALL)) for i in range(3)]
            with pytest.raises(OutOfMemory):
                jobs[0].future.result(timeout=60)
            assert all(len(job.future.result(timeout=60).images) == 1 for job in jobs[1:])
    finally:
        assert worker.close(60)
    assert seen == [["p0", "p1"], ["p0", "p1", "p2"]]
    assert worker.oom_count == 1


def test_close_drains_queued_jobs_before_stopping() -> None:
    worker = GenerationWorker(tiny_adapter(), max_queue=4)
    jobs = [worker.submit(GenerationRequest(prompt=f"p{i}", **SMALL)) for i in range(3)]
    assert worker.close(120)
    assert all(job.future.done() and not job.future.cancelled() for job in jobs)
    assert all(len(job.future.result().images) == 1 for job in jobs)


@contextmanager
def drain_server(
    drain_timeout_s: float, step_sleep_s: float = 0.0
) -> Iterator[tuple[subprocess.Popen[str], str]]:
    process = subprocess.Popen(
        [sys.executable, str(HERE / "drain_server.py"), str(drain_timeout_s), str(step_sleep_s)],
        cwd=HERE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        base = f"http://127.0.0.1:{int(process.stdout.readline())}"
        problem = wait_healthy(base, 120, process, interval_s=0.2)
        assert problem is None, problem
        yield process, base
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def start_requests(base: str, shapes: list[tuple[int, str]], statuses: list[int]) -> list[threading.Thread]:
    """One request per (steps, size), in this order; returns once one runs and the rest are queued."""

    def post(steps: int, size: str) -> None:
        body = {"prompt": "drain me", **FAST, "num_inference_steps": steps, "size": size}
        statuses.append(httpx.post(f"{base}/v1/images/generations", json=body, timeout=120).status_code)

    threads = [threading.Thread(target=post, args=shape) for shape in shapes]
    for thread in threads:
        thread.start()
        time.sleep(0.1)
    deadline = time.monotonic() + 60
    while f"ditq_queue_depth {len(shapes) - 1}" not in httpx.get(f"{base}/metrics").text:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return threads


def assert_draining(base: str) -> None:
    """During the drain the listener stays open and a new request is answered 503 draining."""
    late = httpx.post(f"{base}/v1/images/generations", json={"prompt": "late", **FAST}, timeout=30)
    assert late.status_code == 503 and late.json()["error"]["code"] == "draining"
    assert late.headers["connection"] == "close"
    health = httpx.get(f"{base}/health", timeout=5)
    assert health.status_code == 503 and health.json()["status"] == "draining"


@pytest.mark.slow
def test_sigterm_finishes_running_and_queued_requests_then_exits() -> None:
    with drain_server(drain_timeout_s=60, step_sleep_s=0.02) as (process, base):
        statuses: list[int] = []
        threads = start_requests(base, [(100, "32x32"), (2, "32x32")], statuses)  # 100 x 0.02 s: 2 s running
        process.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert_draining(base)
        for thread in threads:
            thread.join(120)
        assert statuses == [200, 200]
        assert process.wait(60) == 0


@pytest.mark.slow
def test_sigterm_past_the_drain_timeout_stops_the_rest_and_exits_in_bounded_time() -> None:
    """Exit used to take the request timeout plus the drain timeout; now the drain timeout plus one step."""
    with drain_server(drain_timeout_s=1.0, step_sleep_s=0.1) as (process, base):
        statuses: list[int] = []
        threads = start_requests(base, [(200, "32x32"), (200, "32x32")], statuses)  # 20 s each
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert_draining(base)
        for thread in threads:
            thread.join(60)
        assert statuses == [503, 503]  # the queued one withdrawn, the running one stopped between steps
        assert process.wait(30) == 0
        assert time.monotonic() - signalled < 8  # 1 s drain + a step + the graceful close


def test_a_client_that_disconnects_has_its_queued_request_dropped() -> None:
    gated = GatedAdapter(tiny_adapter())
    app = make_app(load=lambda: gated)
    with LiveServer(app) as live:
        assert app.state.serve.wait_loaded(120)
        url = f"{live.base_url}/v1/images/generations"
        held = threading.Thread(
            target=httpx.post, args=(url,), kwargs={"json": {"prompt": "held", **FAST}, "timeout": 60}
        )
        held.start()
        assert gated.entered.acquire(timeout=30)
        body = json.dumps({"prompt": "impatient", **FAST}).encode()
        with socket.create_connection(("127.0.0.1", live.port)) as raw:
            raw.sendall(
                b"POST /v1/images/generations HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                + f"content-length: {len(body)}\r\n\r\n".encode()
                + body
            )
            while app.state.serve.worker.queue_depth < 1:
                time.sleep(0.02)
        deadline = time.monotonic() + 30
        while "ditq_dropped_requests_total 1" not in httpx.get(f"{live.base_url}/metrics").text:
            assert time.monotonic() < deadline, "the disconnected request was not dropped"
            time.sleep(0.1)
        gated.release.set()
        held.join(60)
        assert gated.prompts == ["held"]
        assert (
            'ditq_requests_total{endpoint="generations",status="499"} 1'
            in httpx.get(f"{live.base_url}/metrics").text
        )
