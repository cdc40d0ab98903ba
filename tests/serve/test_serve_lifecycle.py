"""The worker's queue (FIFO, drop on withdrawal, out-of-memory recovery) and SIGTERM draining."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from serve_testkit import FAST, GatedAdapter, LiveServer, make_app, raise_once, tiny_adapter, transformer_hook

from ditq.healthcheck import wait_healthy
from ditq.runtime.adapter import GenerationRequest
from ditq.serve.worker import Cancelled, GenerationWorker, OutOfMemory, QueueClosed, QueueFull

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


def test_close_drains_queued_jobs_before_stopping() -> None:
    worker = GenerationWorker(tiny_adapter(), max_queue=4)
    jobs = [worker.submit(GenerationRequest(prompt=f"p{i}", **SMALL)) for i in range(3)]
    assert worker.close(120)
    assert all(job.future.done() and not job.future.cancelled() for job in jobs)
    assert all(len(job.future.result().images) == 1 for job in jobs)


@pytest.mark.slow
def test_sigterm_finishes_running_and_queued_requests_then_exits() -> None:
    process = subprocess.Popen(
        [sys.executable, str(HERE / "drain_server.py")], cwd=HERE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        base = f"http://127.0.0.1:{int(process.stdout.readline())}"
        deadline = time.monotonic() + 120  # for the health check and the queue below together
        problem = wait_healthy(base, 120, process, interval_s=0.2)
        assert problem is None, problem
        statuses: list[int] = []

        def post(steps: int, size: str) -> None:
            body = {"prompt": "drain me", **FAST, "num_inference_steps": steps, "size": size}
            statuses.append(httpx.post(f"{base}/v1/images/generations", json=body, timeout=120).status_code)

        # The first request must still be running when the second arrives: 200 steps at 64x64 take seconds
        # even on an idle machine (12 steps at 32x32 took 0.05 s, and the queue was never seen holding one).
        threads = [threading.Thread(target=post, args=args) for args in ((200, "64x64"), (2, "32x32"))]
        for thread in threads:
            thread.start()
            time.sleep(0.1)
        while "ditq_queue_depth 1" not in httpx.get(f"{base}/metrics").text:  # one running, one queued
            assert time.monotonic() < deadline
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        try:
            late = httpx.post(f"{base}/v1/images/generations", json={"prompt": "late", **FAST}, timeout=30)
            assert late.status_code == 503 and late.json()["error"]["code"] == "draining"
        except httpx.TransportError:
            pass  # the listening socket is already closed: refused, as it should be
        for thread in threads:
            thread.join(120)
        assert statuses == [200, 200]
        assert process.wait(60) in (0, -signal.SIGTERM)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


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
