"""Admission by cost and cancellation between steps (issue 15, case 1): a request that can never fit is refused
before it runs, a running one stops at its deadline or when its client leaves, and /health says busy or
degraded while that happens."""

from __future__ import annotations

import dataclasses
import io
import socket
import threading
import time
import weakref
from pathlib import Path

import httpx
import pytest
import torch
from PIL import Image
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

from ditq.errors import InputError
from ditq.runtime.adapter import GenerationCancelled, GenerationRequest, GenerationResult, PipelineAdapter
from ditq.serve import state as serve_state
from ditq.serve.cost import CostModel, Measurement, RequestCost, calibrate
from ditq.serve.worker import Cancelled, GenerationWorker

GENERATIONS = "/v1/images/generations"
# The request that wedged the server: inside every fixed limit (2048x2048 <= max_pixels, 200 steps, n=4).
WEDGE = {"prompt": "a city at night", "size": "2048x2048", "num_inference_steps": 200, "n": 4}


def _measured(pixels: int, references: int, step_s: float, memory: int, stages: bool = True) -> Measurement:
    seconds = {"text_encoding": 0.5, "first_step": 2 * step_s, "step": step_s, "decoding": 0.25}
    per_stage = (
        {"first_step": memory, "later_steps": memory // 2, "decoding": memory // 4} if stages else None
    )
    return Measurement(pixels, references, 32 * 32, seconds, per_stage, memory)


def model(
    step_low: float, step_high: float, memory_budget: int | None = None, timeout_s: float = 600
) -> CostModel:
    """A cost model measured at 1024 and 4096 pixels (32x32 and 64x64), without references: step seconds and
    1000 bytes per pixel of memory, text encoding 0.5 s and decoding 0.25 s."""
    return CostModel(
        device="cpu",
        measurements=[_measured(4096, 0, step_high, 1000 * 4096), _measured(1024, 0, step_low, 1000 * 1024)],
        memory_budget_bytes=memory_budget,
        time_budget_s=timeout_s,
    )


def cost(side: int, steps: int = 10, images: int = 1, references: int = 0) -> RequestCost:
    return RequestCost(side * side, steps, images, references, reference_pixels=32 * 32)


def test_a_measured_shape_costs_what_was_measured_and_other_shapes_follow_each_stages_fit() -> None:
    measured = model(step_low=0.1, step_high=0.4, memory_budget=10**9)
    # at 64x64 and 10 steps: 0.5 + 0.8 (first step) + 9 x 0.4 + 0.25
    exact = measured.predict(cost(64))
    assert exact.measured and exact.seconds == pytest.approx(0.5 + 0.8 + 9 * 0.4 + 0.25)
    assert exact.memory_bytes == 1000 * 4096
    # 128x128 was not measured: every stage's line through 1024 and 4096 pixels, continued
    fitted = measured.predict(cost(128))
    step = 0.4 + 0.3 * (16384 - 4096) / 3072
    assert not fitted.measured and fitted.seconds == pytest.approx(0.5 + 2 * step + 9 * step + 0.25)
    assert fitted.memory_bytes == pytest.approx(1000 * 16384, rel=1e-9)  # the largest stage: the first step
    assert measured.seconds(cost(128, images=4)) == pytest.approx(4 * fitted.seconds)
    assert measured.memory_bytes(cost(128, images=2)) == pytest.approx(2 * 1000 * 16384, rel=1e-9)
    # no reference was measured: references cost nothing the measurements could show
    assert measured.predict(cost(64, references=2)).seconds == pytest.approx(exact.seconds)


def test_an_unmeasured_shape_is_bounded_by_a_larger_measured_one_and_served_requests_are_measured() -> None:
    """Measured with 0 and 4 references at one size: 2 references cost at most what 4 did (memory grows with
    both pixels and references); past every measured shape each stage's fit goes on, its slopes never negative
    (a bigger request is never predicted cheaper). A served request's own measurement then prices its shape."""
    with_references = CostModel(
        device="cuda:0",
        measurements=[
            _measured(4096, 4, 0.8, 9000),
            _measured(4096, 0, 0.4, 1000),
            _measured(1024, 0, 0.45, 1100),
        ],
        memory_budget_bytes=None,
        time_budget_s=600,
    )
    two = with_references.predict(cost(64, references=2))
    assert not two.measured and two.memory_bytes == 9000
    assert with_references.predict(cost(128)).memory_bytes >= 1000  # pixels' slope clipped at 0, not negative
    served = GenerationResult(
        images=[], timings={"text_encoding": 0.2, "denoising": 1.0, "total": 1.5}, step_times=[0.6, 0.4],
        peak_memory_bytes=10_000 + 4000, stage_peak_memory_bytes={"first_step": 14_000, "later_steps": 12_000},
        memory_at_start_bytes=10_000,
    )  # fmt: skip
    with_references.observe(cost(64, references=2), served)
    now = with_references.predict(cost(64, references=2, steps=2))
    # text encoding, the first step, one later step and the 0.3 s outside the stages
    assert now.measured and now.memory_bytes == 4000 and now.seconds == pytest.approx(0.2 + 0.6 + 0.4 + 0.3)


def test_with_three_sizes_measured_the_seconds_follow_attentions_square_past_them() -> None:
    """A step that costs 0.05 + 1e-6 * p + 4e-12 * p**2 s, measured at 256², 512² and 1024²: at 2048² it is priced
    at what it costs (74.6 s a step), not at the line through the two largest sizes (25.1 s); memory stays a line."""

    def step_s(pixels: int) -> float:
        return 0.05 + 1e-6 * pixels + 4e-12 * pixels**2

    sizes = (1024 * 1024, 512 * 512, 256 * 256)
    measured = CostModel(
        "cuda:0",
        [Measurement(p, 0, p, {"first_step": step_s(p), "step": step_s(p)}, None, 1000 * p) for p in sizes],
        memory_budget_bytes=None,
        time_budget_s=600,
    )
    large = 2048 * 2048
    prediction = measured.predict(RequestCost(large, 10, 1, 0, large))
    assert not prediction.measured and prediction.seconds == pytest.approx(10 * step_s(large), rel=1e-6)
    line = step_s(sizes[0]) + (step_s(sizes[0]) - step_s(sizes[1])) / (sizes[0] - sizes[1]) * (
        large - sizes[0]
    )
    assert line == pytest.approx(25.14, abs=0.01) and 10 * line < prediction.seconds / 2
    assert prediction.memory_bytes == pytest.approx(1000 * large, rel=1e-9)  # the line, continued
    # 10 steps there take 746 s: past a 600 s timeout, which the line (251 s) would have let through
    why = measured.refusal(RequestCost(large, 10, 1, 0, large))
    assert why is not None and why.budget == "time"
    # two sizes only: the square cannot be told from the line, which is all that is fitted
    two = CostModel("cuda:0", measured.measurements[1:], memory_budget_bytes=None, time_budget_s=600)
    assert two.predict(RequestCost(sizes[0], 1, 1, 0, sizes[0])).seconds < step_s(sizes[0])


def test_refusal_names_the_budget_it_passes() -> None:
    memory_bound = model(0.1, 0.4, memory_budget=50_000_000)
    why = memory_bound.refusal(cost(512, images=4))  # 4 x 262144 px x 1000 B = 1.05 GB > 50 MB
    assert why is not None and why.budget == "memory" and "fitted to the shapes measured" in why.message
    time_bound = model(0.1, 0.4, memory_budget=None, timeout_s=60)
    why = time_bound.refusal(cost(128, steps=200))
    assert why is not None and why.budget == "time" and "more than the request timeout of 60 s" in why.message
    assert time_bound.refusal(cost(64, steps=10)) is None
    ran_out = CostModel("cuda:0", [_measured(4096, 0, 0.1, 10), Measurement(4096, 4, 1024, {}, None, None, True)],
                        memory_budget_bytes=10**12, time_budget_s=600)  # fmt: skip
    why = ran_out.refusal(cost(64, references=4))
    assert why is not None and why.budget == "memory" and "ran out of memory" in why.message


def test_calibration_measures_the_tiny_pipeline_at_the_shapes_it_serves() -> None:
    adapter = tiny_adapter()
    cost_model = calibrate(adapter, torch.device("cpu"), max_pixels=256 * 256, time_budget_s=600)
    width, height = adapter.default_size
    most = adapter.max_reference_images
    shapes = [(m.pixels, m.references) for m in cost_model.measurements]
    assert shapes[: most + 1] == [(width * height, k) for k in range(most, -1, -1)]  # the largest first
    assert shapes[most + 1 :] == [
        (width * height // 4, most),
        (width * height // 4, 0),
        (width * height // 16, 0),
    ]
    assert all(m.seconds["step"] > 0 and m.memory_bytes is not None for m in cost_model.measurements)
    assert all(m.stage_memory_bytes is None for m in cost_model.measurements)  # stage memory is CUDA's
    assert cost_model.memory_budget_bytes is not None and cost_model.memory_budget_bytes > 0
    wedge = RequestCost(2048 * 2048, 200, 4, 0, 32 * 32)
    assert cost_model.refusal(wedge) is not None
    assert cost_model.refusal(RequestCost(32 * 32, 2, 1, 0, 32 * 32)) is None


class _Placement:
    """An auto placement that can take one step."""

    def __init__(self) -> None:
        self.steps: list[str] = []

    def demote(self, _pipeline: object, _stage: str | None = None) -> str | None:
        if self.steps:
            return None
        self.steps.append("streamed")
        return "streamed"

    def restore(self, _pipeline: object, keep: int) -> list[str]:
        undone = self.steps[keep:][::-1]
        del self.steps[keep:]
        return undone


class _RunsOutAtTheLargest(PipelineAdapter):
    """The tiny pipeline, out of accelerator memory at the default size with the most references while
    ``fits()`` says so."""

    def __init__(self, fits) -> None:  # type: ignore[no-untyped-def]
        super().__init__(tiny_adapter().pipeline)
        self.fits = fits
        self.failures = 0

    def runs_out_at(self, request: GenerationRequest) -> bool:
        return len(request.images) == self.max_reference_images and request.width == self.default_size[0]

    def __call__(self, request: GenerationRequest) -> GenerationResult:
        if self.runs_out_at(request) and not self.fits():
            self.failures += 1
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return super().__call__(request)


def test_a_calibration_that_runs_out_of_memory_demotes_the_placement_and_measures_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    placement = _Placement()
    adapter = _RunsOutAtTheLargest(lambda: bool(placement.steps))
    monkeypatch.setattr(adapter.pipeline, "ditq_placement", placement, raising=False)
    measured = calibrate(adapter, torch.device("cpu"), max_pixels=256 * 256, time_budget_s=600)
    assert adapter.failures == 1 and placement.steps == ["streamed"]
    assert not any(m.out_of_memory for m in measured.measurements)
    assert (
        measured.measurements[0].references == adapter.max_reference_images
    )  # measured again, largest first

    # with nothing left to move, the shape is recorded as out of memory, and requests of that shape are refused
    stuck = _RunsOutAtTheLargest(lambda: False)
    measured = calibrate(stuck, torch.device("cpu"), max_pixels=256 * 256, time_budget_s=600)
    assert [m.out_of_memory for m in measured.measurements][:2] == [True, False]
    width, height = stuck.default_size
    shape = RequestCost(width * height, 3, 1, stuck.max_reference_images, stuck.reference_pixels or 0)
    why = measured.refusal(shape)
    assert why is not None and why.budget == "memory" and "ran out of memory" in why.message


class _Undoable:
    """An auto placement that can take two steps and undo them."""

    def __init__(self) -> None:
        self.steps: list[str] = []
        self.undone: list[str] = []

    def demote(self, _pipeline: object, _stage: str | None = None) -> str | None:
        if len(self.steps) == 2:
            return None
        self.steps.append(f"step {len(self.steps) + 1}")
        return self.steps[-1]

    def restore(self, _pipeline: object, keep: int) -> list[str]:
        undone = self.steps[keep:][::-1]
        del self.steps[keep:]
        self.undone += undone
        return undone


def test_a_shape_out_of_memory_with_everything_moved_leaves_the_placement_as_it_was(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The largest shape runs out of memory whatever moves: the two steps taken for it are undone, it is recorded
    as out of memory without running again, and every other shape is measured under the placement it started with
    (not left streamed for a shape no placement serves)."""
    placement = _Undoable()
    adapter = _RunsOutAtTheLargest(lambda: False)
    monkeypatch.setattr(adapter.pipeline, "ditq_placement", placement, raising=False)
    measured = calibrate(adapter, torch.device("cpu"), max_pixels=256 * 256, time_budget_s=600)
    assert adapter.failures == 3  # as placed, after one step, after both
    assert placement.steps == [] and placement.undone == ["step 2", "step 1"]
    assert [m.out_of_memory for m in measured.measurements][:2] == [True, False]
    assert not any(m.out_of_memory for m in measured.measurements[1:])


class _RunsOutUntilMoved(_RunsOutAtTheLargest):
    """The tiny pipeline, out of accelerator memory at every shape until the placement has taken ``steps`` steps:
    the smallest request too, which calibration runs first to warm up."""

    def __init__(self, placement: _Undoable, steps: int) -> None:
        super().__init__(lambda: len(placement.steps) >= steps)

    def runs_out_at(self, request: GenerationRequest) -> bool:
        return True


def test_a_smallest_request_out_of_memory_as_placed_moves_the_placement_instead_of_failing_the_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The warm-up at the smallest shape runs out of memory (on an H100 under 16 GiB, the BF16 model's streamed
    text encoder's embedding beside the resident transformer): the placement takes a step and calibration goes on;
    with nothing left to move the start fails in one line naming the budget."""
    placement = _Undoable()
    adapter = _RunsOutUntilMoved(placement, steps=1)
    monkeypatch.setattr(adapter.pipeline, "ditq_placement", placement, raising=False)
    measured = calibrate(adapter, torch.device("cpu"), max_pixels=256 * 256, time_budget_s=600)
    assert adapter.failures == 1 and placement.steps == ["step 1"]
    assert not any(m.out_of_memory for m in measured.measurements)

    placement = _Undoable()
    stuck = _RunsOutUntilMoved(placement, steps=3)  # two steps are all it has
    monkeypatch.setattr(stuck.pipeline, "ditq_placement", placement, raising=False)
    with pytest.raises(
        InputError, match=r"^--max-memory/--offload auto: the smallest request \(\d+x\d+\) ran out"
    ):
        calibrate(stuck, torch.device("cpu"), max_pixels=256 * 256, time_budget_s=600)
    assert stuck.failures == 3


class _PeakWhenMoved:
    """A memory probe whose peak is ``moved`` bytes once the placement has taken two steps (the streamed weights'
    copies counted in it), else ``placed``."""

    def __init__(self, placement: _Undoable, placed: int, moved: int) -> None:
        self.placement, self.placed, self.moved = placement, placed, moved

    def __call__(self, _device: torch.device) -> _PeakWhenMoved:
        return self

    def start(self) -> None:
        pass

    def peak_above_start(self) -> int:
        return self.moved if len(self.placement.steps) == 2 else self.placed


def test_a_shape_that_runs_only_above_the_budget_once_moved_leaves_the_placement_as_it_was(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The largest shape runs out of memory as placed and after one step, and runs after the second, but above
    what the cost model lets a request add: it would be refused anyway, so the two steps are undone, it is recorded
    as out of memory and the other shapes are measured where they were (on an H100 under 16 GiB, 0-3 references
    were served streamed, 1.40-1.85x slower, for a 4-reference shape then refused)."""
    from ditq.serve import cost as cost_module

    placement = _Undoable()
    adapter = _RunsOutAtTheLargest(lambda: len(placement.steps) == 2)
    monkeypatch.setattr(adapter.pipeline, "ditq_placement", placement, raising=False)
    monkeypatch.setattr(cost_module, "MemoryProbe", _PeakWhenMoved(placement, placed=1000, moved=10**9))
    monkeypatch.setattr(cost_module, "free_memory_bytes", lambda _device, _budget: 10**6)
    measured = calibrate(adapter, torch.device("cpu"), max_pixels=256 * 256, time_budget_s=600)
    assert adapter.failures == 2  # as placed, after one step; then it ran, above the budget
    assert placement.steps == [] and placement.undone == ["step 2", "step 1"]
    assert [m.out_of_memory for m in measured.measurements][:2] == [True, False]
    assert all(m.memory_bytes == 1000 for m in measured.measurements[1:])
    width, height = adapter.default_size
    largest = RequestCost(width * height, 3, 1, adapter.max_reference_images, adapter.reference_pixels or 0)
    assert measured.refusal(largest) is not None

    # within the budget, the shape keeps the placement it ran under
    placement = _Undoable()
    adapter = _RunsOutAtTheLargest(lambda: len(placement.steps) == 2)
    monkeypatch.setattr(adapter.pipeline, "ditq_placement", placement, raising=False)
    monkeypatch.setattr(cost_module, "MemoryProbe", _PeakWhenMoved(placement, placed=1000, moved=10**5))
    measured = calibrate(adapter, torch.device("cpu"), max_pixels=256 * 256, time_budget_s=600)
    assert placement.steps == ["step 1", "step 2"] and not any(m.out_of_memory for m in measured.measurements)


class _Held:
    """What a failed call's frame holds (its activations, on a GPU)."""


class _HoldsWhatItRanOutWith(_RunsOutAtTheLargest):
    """Out of memory at the largest shape with an object alive in the failing call's frame, as a CUDA out-of-memory
    error keeps the forward's activations alive through its traceback."""

    def __call__(self, request: GenerationRequest) -> GenerationResult:
        held = _Held()
        self.held = weakref.ref(held)
        return super().__call__(request)


class _ChecksTheFailedCallIsGone(_Undoable):
    """Each placement move asserts that the failed call's frame was let go before it: moving a component back onto
    a full device needs the memory that call held."""

    def __init__(self, adapter: _HoldsWhatItRanOutWith) -> None:
        super().__init__()
        self.adapter = adapter

    def demote(self, pipeline: object, stage: str | None = None) -> str | None:
        assert self.adapter.held() is None, "the placement moved while the failed call was still held"
        return super().demote(pipeline, stage)

    def restore(self, pipeline: object, keep: int) -> list[str]:
        assert self.adapter.held() is None, "the placement moved while the failed call was still held"
        return super().restore(pipeline, keep)


def test_the_placement_moves_only_after_the_failed_call_is_let_go(monkeypatch: pytest.MonkeyPatch) -> None:
    adapter = _HoldsWhatItRanOutWith(lambda: False)
    placement = _ChecksTheFailedCallIsGone(adapter)
    monkeypatch.setattr(adapter.pipeline, "ditq_placement", placement, raising=False)
    measured = calibrate(adapter, torch.device("cpu"), max_pixels=256 * 256, time_budget_s=600)
    assert adapter.failures == 3 and placement.undone == ["step 2", "step 1"]
    assert [m.out_of_memory for m in measured.measurements][:2] == [True, False]


def test_a_request_that_can_never_fit_is_413_before_it_runs_and_the_next_one_is_served() -> None:
    # a 30 s timeout: the wedge's 4 x 200 steps at 2048x2048 pass it on any CPU by a wide margin (a step at 256x256
    # would have to take under 0.6 ms), and a misprediction fails in 30 s rather than hanging the suite
    config = dataclasses.replace(WARN, max_pixels=2048 * 2048, request_timeout_s=30.0)

    def measured(adapter: PipelineAdapter) -> CostModel:
        return calibrate(adapter, torch.device("cpu"), 256 * 256, config.request_timeout_s)

    app = make_app(config, calibrate=measured)
    with client_for(app) as client:
        health = client.get("/health").json()
        assert health["status"] == "ready" and health["cost_model"]["measurements"][0]["pixels"] > 0
        assert health["calibration_seconds"] > 0
        response = client.post(GENERATIONS, json=WEDGE)
        assert response.status_code == 413, response.text
        error = response.json()["error"]
        assert "can never run here" in error["message"]
        # memory is checked first; each budget has its own code
        expected = "over_memory_budget" if "for activations" in error["message"] else "over_budget"
        assert error["code"] == expected, error
        assert app.state.serve.worker.finished == 0  # refused before it was queued
        assert client.get("/health").json()["status"] == "ready"
        assert client.post(GENERATIONS, json={"prompt": "a kite", **FAST}).status_code == 200


def test_work_queued_ahead_past_the_deadline_is_429_busy_with_retry_after() -> None:
    gated = GatedAdapter(tiny_adapter())
    config = dataclasses.replace(WARN, request_timeout_s=5.0)
    # FAST (32x32, 2 steps) costs 2 x 1.0 s here: one running + one queued leave no room for a third
    one_second_steps = CostModel(
        "cpu", [Measurement(1024, 0, 1024, {"first_step": 1.0, "step": 1.0}, None, None)], None, 5.0
    )
    app = make_app(config, load=lambda: gated, calibrate=lambda _adapter: one_second_steps)
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


def test_max_references_caps_what_a_request_carries_and_what_calibration_measures(
    demo_artifacts: dict[str, Path],
) -> None:
    """`ditq serve --max-references 1` (a sweep passes its fixtures' most): calibration measures shapes of at most
    one reference, no further, and a request with two is refused before it runs."""
    from fastapi.testclient import TestClient

    from ditq.runtime.options import LoadOptions
    from ditq.serve import ServeConfig
    from ditq.serve.server import serving_app

    config = ServeConfig(served_model_name="tiny", on_collapse="warn", max_pixels=32 * 32, max_references=1)
    app, _ = serving_app(demo_artifacts["w8a8"], config, LoadOptions(device="cpu"))
    picture = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 40, 40)).save(picture, format="PNG")
    files = [("image[]", (f"ref{i}.png", picture.getvalue(), "image/png")) for i in range(2)]
    with TestClient(app) as client:
        assert app.state.serve.wait_loaded(300)
        measured = client.get("/health").json()["cost_model"]["measurements"]
        assert sorted({m["references"] for m in measured}) == [0, 1]  # the pipeline takes 4
        two = client.post("/v1/images/edits", data={"prompt": "two", "size": "32x32"}, files=files)
        fast = {name: str(value) for name, value in FAST.items()}  # form fields are text
        one = client.post("/v1/images/edits", data={**fast, "prompt": "one"}, files=files[:1])
    assert two.status_code == 400 and "at most 1" in two.json()["error"]["message"], two.text
    assert one.status_code == 200, one.text
