"""Admission by cost and cancellation between steps (issue 15, case 1): a request that can never fit is refused
before it runs, a running one stops at its deadline or when its client leaves, and /health says busy or
degraded while that happens."""

from __future__ import annotations

import dataclasses
import socket
import threading
import time

import httpx
import pytest
import torch
from serve_testkit import (
    FAST,
    WARN,
    GatedAdapter,
    LiveServer,
    client_for,
    make_app,
    sleep_per_step,
    tiny_adapter,
    transformer_hook,
)

from ditq.runtime.adapter import GenerationCancelled, GenerationRequest, PipelineAdapter
from ditq.serve import state as serve_state
from ditq.serve.cost import CostModel, Point, RequestCost, calibrate
from ditq.serve.worker import Cancelled, GenerationWorker

GENERATIONS = "/v1/images/generations"
# The request that wedged the server: inside every fixed limit (2048x2048 <= max_pixels, 200 steps, n=4).
WEDGE = {"prompt": "a city at night", "size": "2048x2048", "num_inference_steps": 200, "n": 4}


def model(
    step_low: float, step_high: float, memory_budget: int | None = None, timeout_s: float = 600
) -> CostModel:
    """A cost model measured at 1024 and 4096 pixels (32x32 and 64x64)."""
    return CostModel(
        device="cpu",
        low=Point(1024, step_low, 1000 * 1024),
        high=Point(4096, step_high, 1000 * 4096),
        memory_budget_bytes=memory_budget,
        time_budget_s=timeout_s,
    )


def cost(side: int, steps: int = 10, images: int = 1, references: int = 0) -> RequestCost:
    return RequestCost(side * side, steps, images, references, reference_pixels=32 * 32)


def test_lower_bounds_follow_the_chord_past_the_larger_point() -> None:
    cost_model = model(step_low=0.1, step_high=0.4, memory_budget=10**9)
    # 0.1 s at 1024 px, 0.4 s at 4096 px: 0.3 s per 3072 px past 4096, per step and per image
    assert cost_model.seconds(cost(16)) == 0.0  # below the first point: nothing known
    assert cost_model.seconds(cost(32)) == pytest.approx(10 * 0.1)
    assert cost_model.seconds(cost(64)) == pytest.approx(10 * 0.4)
    assert cost_model.seconds(cost(128)) == pytest.approx(10 * (0.4 + 0.3 * (16384 - 4096) / 3072))
    assert cost_model.seconds(cost(128, images=4)) == pytest.approx(4 * cost_model.seconds(cost(128)))
    # two 32x32 references add 2048 pixels to each image's sequence
    assert cost_model.seconds(cost(64, references=2)) == pytest.approx(10 * (0.4 + 0.3 * 2048 / 3072))
    assert cost_model.memory_bytes(cost(128, images=2)) == 2 * 1000 * 16384  # 1000 bytes per pixel


def test_refusal_names_the_budget_it_passes() -> None:
    memory_bound = model(0.1, 0.4, memory_budget=50_000_000)
    why = memory_bound.refusal(cost(512, images=4))  # 4 x 262144 px x 1000 B = 1.05 GB > 50 MB
    assert why is not None and why.budget == "memory" and "GiB for activations" in why.message
    time_bound = model(0.1, 0.4, memory_budget=None, timeout_s=60)
    why = time_bound.refusal(cost(128, steps=200))
    assert why is not None and why.budget == "time" and "more than the request timeout of 60 s" in why.message
    assert time_bound.refusal(cost(64, steps=10)) is None


def test_calibration_measures_the_tiny_pipeline_on_this_cpu() -> None:
    cost_model = calibrate(tiny_adapter(), torch.device("cpu"), max_pixels=256 * 256, time_budget_s=600)
    assert cost_model.low.pixels < cost_model.high.pixels <= 256 * 256
    assert cost_model.low.step_seconds > 0 and cost_model.high.step_seconds > 0
    assert cost_model.memory_budget_bytes is not None and cost_model.memory_budget_bytes > 0
    assert cost_model.high.memory_bytes is not None  # /proc/self/clear_refs works on Linux
    wedge = RequestCost(2048 * 2048, 200, 4, 0, 32 * 32)
    assert cost_model.refusal(wedge) is not None
    assert cost_model.refusal(RequestCost(32 * 32, 2, 1, 0, 32 * 32)) is None


def test_a_request_that_can_never_fit_is_413_before_it_runs_and_the_next_one_is_served() -> None:
    config = dataclasses.replace(WARN, max_pixels=2048 * 2048)

    def measured(adapter: PipelineAdapter) -> CostModel:
        return calibrate(adapter, torch.device("cpu"), 256 * 256, config.request_timeout_s)

    app = make_app(config, calibrate=measured)
    with client_for(app) as client:
        health = client.get("/health").json()
        assert health["status"] == "ready" and health["cost_model"]["high"]["pixels"] > 0
        assert health["calibration_seconds"] > 0
        response = client.post(GENERATIONS, json=WEDGE)
        assert response.status_code == 413, response.text
        error = response.json()["error"]
        assert "can never run here" in error["message"]
        # memory is checked first; each budget has its own code
        expected = "over_memory_budget" if "GiB for activations" in error["message"] else "over_budget"
        assert error["code"] == expected, error
        assert app.state.serve.worker.finished == 0  # refused before it was queued
        assert client.get("/health").json()["status"] == "ready"
        assert client.post(GENERATIONS, json={"prompt": "a kite", **FAST}).status_code == 200


def test_work_queued_ahead_past_the_deadline_is_429_busy_with_retry_after() -> None:
    gated = GatedAdapter(tiny_adapter())
    config = dataclasses.replace(WARN, request_timeout_s=5.0)
    # FAST (32x32, 2 steps) costs at least 2 x 1.0 s here: one running + one queued leave no room for a third
    app = make_app(config, load=lambda: gated, calibrate=lambda _adapter: model(1.0, 1.0, timeout_s=5.0))
    with client_for(app) as client:
        statuses: list[int] = []

        def post(prompt: str) -> None:
            statuses.append(client.post(GENERATIONS, json={"prompt": prompt, **FAST}).status_code)

        threads = [threading.Thread(target=post, args=("running",))]
        threads[0].start()
        assert gated.entered.acquire(timeout=30)
        threads.append(threading.Thread(target=post, args=("queued",)))
        threads[1].start()
        while app.state.serve.worker.queue_depth < 1:
            time.sleep(0.02)
        health = client.get("/health").json()
        assert health["status"] == "busy" and health["queue_depth"] == 1 and health["estimated_wait_s"] > 2
        refused = client.post(GENERATIONS, json={"prompt": "third", **FAST})
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "busy"
        assert int(refused.headers["retry-after"]) >= 2
        gated.release.set()
        for thread in threads:
            thread.join(60)
        assert statuses == [200, 200]


def test_a_running_generation_stops_at_its_deadline_and_the_next_request_is_served_at_once() -> None:
    config = dataclasses.replace(WARN, request_timeout_s=1.0)
    app = make_app(config)
    with client_for(app) as client, transformer_hook(tiny_adapter(), sleep_per_step(0.05)):
        started = time.perf_counter()
        slow = client.post(GENERATIONS, json={"prompt": "slow", "size": "32x32", "num_inference_steps": 200})
        assert slow.status_code == 504 and slow.json()["error"]["code"] == "timeout"
        assert time.perf_counter() - started < 3  # 200 steps of 0.05 s would take 10 s
        quick = client.post(GENERATIONS, json={"prompt": "next", **FAST})
        assert quick.status_code == 200, quick.text
        assert quick.json()["metrics"]["queue_wait_ms"] < 1000  # the stopped one did not run on
        worker = app.state.serve.worker
        while not worker.idle:  # the worker counts a job just after answering it
            time.sleep(0.01)
        assert (worker.stopped, worker.finished) == (1, 2)
        assert "ditq_stopped_generations_total 1" in client.get("/metrics").text


def test_a_client_that_leaves_has_its_running_generation_stopped() -> None:
    app = make_app()
    with LiveServer(app) as live, transformer_hook(tiny_adapter(), sleep_per_step(0.05)):
        assert app.state.serve.wait_loaded(120)
        worker = app.state.serve.worker
        body = b'{"prompt": "leaving", "size": "32x32", "num_inference_steps": 200}'
        with socket.create_connection(("127.0.0.1", live.port)) as raw:
            raw.sendall(
                b"POST /v1/images/generations HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                + f"content-length: {len(body)}\r\n\r\n".encode()
                + body
            )
            while not worker.busy:
                time.sleep(0.02)
        deadline = time.monotonic() + 5  # far less than 200 steps x 0.05 s
        while worker.stopped < 1:
            assert time.monotonic() < deadline, "the running generation was not stopped"
            time.sleep(0.05)
        assert httpx.get(f"{live.base_url}/health").json()["status"] == "ready"
        assert 'endpoint="generations",status="499"' in httpx.get(f"{live.base_url}/metrics").text


def test_health_is_degraded_while_a_stopped_generation_keeps_running(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serve_state, "OVERDUE_GRACE_S", 0.2)
    gated = GatedAdapter(tiny_adapter())  # holds the worker without reaching a step: cannot stop yet
    config = dataclasses.replace(WARN, request_timeout_s=0.5)
    with client_for(make_app(config, load=lambda: gated)) as client:
        assert client.post(GENERATIONS, json={"prompt": "stuck", **FAST}).status_code == 504
        time.sleep(0.3)
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "degraded"
        assert health.json()["running"]["stop_requested"] == "timeout"
        gated.release.set()  # the first step ends, the stop takes effect
        deadline = time.monotonic() + 30
        while client.get("/health").json()["status"] != "ready":
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_the_adapter_raises_between_steps_once_should_stop_answers() -> None:
    calls: list[int] = []

    def stop_after_three() -> str | None:
        calls.append(1)
        return "timeout" if len(calls) >= 3 else None

    request = GenerationRequest(prompt="x", width=32, height=32, num_inference_steps=10, seed=0)
    with pytest.raises(GenerationCancelled) as stopped:
        tiny_adapter()(dataclasses.replace(request, should_stop=stop_after_three))
    assert (stopped.value.reason, stopped.value.steps_done) == ("timeout", 3)
    assert len(tiny_adapter()(request).images) == 1  # the pipeline is usable afterwards


def test_on_the_cpu_a_generation_past_the_resident_budget_stops_as_out_of_memory() -> None:
    worker = GenerationWorker(tiny_adapter(), max_queue=1, resident_limit_bytes=1)
    try:
        job = worker.submit(GenerationRequest(prompt="x", width=32, height=32, num_inference_steps=5, seed=0))
        with pytest.raises(Cancelled) as stopped:
            job.future.result(timeout=60)
        assert stopped.value.reason == "out_of_memory" and stopped.value.steps_done == 1
        assert worker.oom_count == 1
    finally:
        assert worker.close(60)
