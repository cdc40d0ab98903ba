"""What a request costs the device, measured at start-up at the shapes the server serves, and the budget it must fit.

A request asks for ``n`` images of ``pixels`` each, every one read together with its ``references``, over
``steps`` denoising steps. Start-up runs real requests (n=1, two steps, the pipeline's default guidance,
after one warm-up call) at the shapes a client sends most: the pipeline's default size with 0 up to its largest
reference count, half that size with none and with the most, and a quarter of it with none, the largest first.
Each measurement keeps
what the stage clock saw (``ditq.runtime.stage_clock``): seconds per stage (text encoding, image encoding, the
first denoising step, each later step, decoding) and, on CUDA, the peak memory of each stage above what was
held before the call.

A request's cost is what was measured at its shape (at start-up, or by an earlier request of that shape: every
served request is a measurement); at a shape not measured, its peak memory is the least measured at a shape at
least as large (more pixels and references), and where there is none, and for seconds, each stage comes from a
model of that stage fitted to the measurements: ``a + b * pixels + c * references``, least squares with ``b``
and ``c`` kept non-negative, and for seconds ``+ d * pixels**2`` too where three sizes were measured (attention's
time is quadratic in tokens, so a line through the small sizes prices a large request low; memory is linear in
tokens with fused attention; a pipeline reads each reference at one size, its reference size or, for
Qwen-Image-2.1, its output resolution, whatever the output's). A
request costs ``n`` times one image, its peak the largest stage's. A request is refused before it is queued
when its cost passes a budget:

- memory: what the device has free for activations after loading (CUDA: the allocator's budget under
  ``--max-memory`` or the device's free memory; the CPU: the host's available memory, cgroup limit included),
  or a shape whose calibration ran out of memory;
- time: the request timeout.

Either is 413: ``over_memory_budget`` (it does not fit this server's memory; a server with more offload may take
it) or ``over_budget`` (time). The same seconds, summed over the queue, say how long a new request would wait
(429 ``busy`` when that alone passes its deadline). Every response carries the predicted peak, so the probe and
the report can check the model against what each request then measured.

With ``--offload auto`` a calibration request that runs out of memory makes the placement take its next step
(``ditq.runtime.offload.Placement.demote``: VAE tiling, then streaming) and is measured again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from ditq.runtime.adapter import GenerationRequest, GenerationResult, PipelineAdapter
from ditq.runtime.compile import compiled_graphs
from ditq.runtime.memory import host_available_bytes, return_free_host_memory
from ditq.runtime.offload import demote_until_it_runs, runs_out
from ditq.serve.metrics import resident_memory_bytes

__all__ = [
    "CostModel",
    "Measurement",
    "MemoryProbe",
    "Prediction",
    "Refusal",
    "RequestCost",
    "calibrate",
    "calibration_shapes",
    "free_memory_bytes",
    "request_cost",
]

logger = logging.getLogger(__name__)

# The first step may do one-time work (a prefix cache); the second is the steady step.
_CALIBRATION_STEPS = 2
CALIBRATION_LIMIT_S = 90.0  # past this, shapes not yet measured are priced from the fit to those that were
STAGES = ("text_encoding", "image_encoding", "first_step", "step", "decoding", "other")  # seconds per image


@dataclass(frozen=True)
class RequestCost:
    """The shape of one request's work."""

    pixels: int  # width * height of one output image
    steps: int
    images: int  # n
    references: int
    reference_pixels: int  # what one reference becomes inside the pipeline

    @property
    def sequence_pixels(self) -> int:
        """Pixels the transformer reads for one output image: the image and its references."""
        return self.pixels + self.references * self.reference_pixels

    def describe(self) -> str:
        return (
            f"{self.images} image(s) x ({self.pixels} + {self.references} reference(s) x {self.reference_pixels}) "
            f"pixels x {self.steps} steps"
        )


@dataclass(frozen=True)
class Refusal:
    """Why a request can never fit: the budget it passes (``memory`` or ``time``) and by how much."""

    budget: str
    message: str


@dataclass(frozen=True)
class Measurement:
    """One calibration request (n=1) at one shape, as the stage clock measured it."""

    pixels: int
    references: int
    reference_pixels: int
    seconds: dict[str, float]  # STAGES -> seconds for one image ("step": one later denoising step)
    # bytes above what was held before the call, per stage (CUDA), and their maximum (CUDA, or the CPU's resident
    # high-water mark); None where it cannot be read
    stage_memory_bytes: dict[str, int] | None
    memory_bytes: int | None
    out_of_memory: bool = False  # the request ran out of memory at this shape (nothing else measured)

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.pixels, self.references, self.reference_pixels

    @classmethod
    def of(cls, cost: RequestCost, result: GenerationResult, probe_peak: int | None = None) -> Measurement:
        """What one n=1 request at ``cost``'s shape measured: its stage seconds, and its stage memory above what was
        held when it began (CUDA), else ``probe_peak`` (the CPU's resident high-water mark)."""
        timings, steps = result.timings, result.step_times
        seconds = {
            "text_encoding": timings.get("text_encoding", 0.0),
            "image_encoding": timings.get("image_encoding", 0.0),
            "first_step": steps[0] if steps else timings.get("denoising", 0.0),
            "step": min(steps[1:]) if len(steps) > 1 else (steps[0] if steps else 0.0),
            "decoding": timings.get("decoding", 0.0),
        }
        staged = sum(
            timings.get(s, 0.0) for s in ("text_encoding", "image_encoding", "denoising", "decoding")
        )
        seconds["other"] = max(0.0, timings.get("total", 0.0) - staged)
        start = result.memory_at_start_bytes
        stages = (
            {stage: max(0, peak - start) for stage, peak in result.stage_peak_memory_bytes.items()}
            if result.stage_peak_memory_bytes is not None and start is not None
            else None
        )
        total = max(stages.values()) if stages else probe_peak
        return cls(cost.pixels, cost.references, cost.reference_pixels, seconds, stages, total)


@dataclass(frozen=True)
class Prediction:
    """A request's cost: seconds and peak bytes above the resident model, and whether its shape was measured."""

    seconds: float
    memory_bytes: int | None
    measured: bool  # True: this shape was calibrated; False: the fitted model
    out_of_memory: bool = False  # its shape ran out of memory at calibration


def _fit(
    points: Sequence[tuple[float, float, float]], quadratic: bool = False
) -> tuple[float, float, float, float]:
    """(a, b, c, d) of ``y = a + b * pixels + c * references + d * pixels**2`` over (pixels, references, y), least
    squares with b, c, d >= 0; a feature that does not vary among the points gets 0, and the square term is fitted
    only where ``quadratic`` and at least three sizes were measured (two sizes cannot tell it from the line)."""
    scale = max(p for p, _, _ in points) or 1.0  # pixels in units of the largest: a well-conditioned system
    x = np.array([[1.0, p / scale, r, (p / scale) ** 2] for p, r, _ in points])
    y = np.array([v for _, _, v in points])
    active = [0] + [j for j in (1, 2) if np.ptp(x[:, j]) > 0]
    if quadratic and len({p for p, _, _ in points}) >= 3:
        active.append(3)
    while True:
        solution, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        negative = [j for j, value in zip(active, solution, strict=True) if j and value < 0]
        if not negative:
            break
        active = [j for j in active if j not in negative]
    coefficients = [0.0, 0.0, 0.0, 0.0]
    for j, value in zip(active, solution, strict=True):
        coefficients[j] = float(value)
    a, b, c, d = coefficients
    return a, b / scale, c, d / scale**2


@dataclass
class CostModel:
    """A request's predicted run time and peak memory on this device, from measurements, and the budgets."""

    device: str
    measurements: list[Measurement]
    memory_budget_bytes: int | None  # free for activations after loading; None: unknown (not enforced)
    time_budget_s: float  # the request timeout
    # the LoRA adapters' weights (``ditq serve --lora``), resident beside the model: loaded before the budget is read,
    # so it is what is left beside them, and measured active (all of them), the costliest choice a request can make
    adapter_bytes: int = 0
    _fits: dict[str, tuple[float, float, float, float]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._refit()

    def _refit(self) -> None:
        served = [m for m in self.measurements if not m.out_of_memory]
        if not served:
            raise ValueError("a cost model needs at least one measurement that fitted")
        for stage in STAGES:
            self._fits[f"s:{stage}"] = _fit(
                [(m.pixels, m.references, m.seconds.get(stage, 0.0)) for m in served], quadratic=True
            )
        memory = [m for m in served if m.stage_memory_bytes is not None]
        for stage in sorted({s for m in memory for s in m.stage_memory_bytes or {}}):
            self._fits[f"m:{stage}"] = _fit(
                [(m.pixels, m.references, (m.stage_memory_bytes or {}).get(stage, 0)) for m in memory]
            )
        totals = [m for m in served if m.memory_bytes is not None]
        if totals:
            self._fits["m:total"] = _fit([(m.pixels, m.references, m.memory_bytes or 0) for m in totals])

    def observe(self, cost: RequestCost, result: GenerationResult) -> None:
        """A served request's measurement (n=1, with stage memory): its shape is measured from now on."""
        if cost.images != 1 or result.stage_peak_memory_bytes is None:
            return
        measured = Measurement.of(cost, result)
        with self._lock:
            kept = [m for m in self.measurements if m.shape != measured.shape]
            self.measurements = [*kept, measured]
            self._refit()

    def _dominating(self, cost: RequestCost) -> int | None:
        """The least peak measured at a shape at least as large (pixels and references): what the request cannot
        exceed, where memory grows with both. None when no measured shape is that large."""
        peaks = [
            m.memory_bytes
            for m in self.measurements
            if not m.out_of_memory
            and m.memory_bytes is not None
            and m.pixels >= cost.pixels
            and m.references >= cost.references
        ]
        return min(peaks) if peaks else None

    def _fitted(self, key: str, cost: RequestCost) -> float:
        a, b, c, d = self._fits[key]
        return max(0.0, a + b * cost.pixels + c * cost.references + d * cost.pixels**2)

    def _measured(self, cost: RequestCost) -> Measurement | None:
        shape = (cost.pixels, cost.references, cost.reference_pixels)
        return next((m for m in self.measurements if m.shape == shape), None)

    @staticmethod
    def _seconds(per_stage: dict[str, float], cost: RequestCost) -> float:
        fixed = sum(per_stage.get(s, 0.0) for s in STAGES if s != "step")
        return cost.images * (fixed + max(0, cost.steps - 1) * per_stage.get("step", 0.0))

    def predict(self, cost: RequestCost) -> Prediction:
        with self._lock:
            return self._predict(cost)

    def _predict(self, cost: RequestCost) -> Prediction:
        measured = self._measured(cost)
        if measured is not None and measured.out_of_memory:
            return Prediction(float("inf"), None, measured=True, out_of_memory=True)
        if measured is not None:
            memory = None if measured.memory_bytes is None else cost.images * measured.memory_bytes
            return Prediction(self._seconds(measured.seconds, cost), memory, measured=True)
        seconds = self._seconds({s: self._fitted(f"s:{s}", cost) for s in STAGES}, cost)
        stages = [k for k in self._fits if k.startswith("m:") and k != "m:total"]
        peak: float | None = self._dominating(cost)
        if peak is None and stages:
            peak = max(self._fitted(k, cost) for k in stages)
        elif peak is None and "m:total" in self._fits:
            peak = self._fitted("m:total", cost)
        return Prediction(seconds, None if peak is None else int(cost.images * peak), measured=False)

    def seconds(self, cost: RequestCost) -> float:
        return self.predict(cost).seconds

    def memory_bytes(self, cost: RequestCost) -> int | None:
        return self.predict(cost).memory_bytes

    def refusal(self, cost: RequestCost) -> Refusal | None:
        """Why the request cannot run here (memory first), or None."""
        prediction = self.predict(cost)
        where = "measured at this shape" if prediction.measured else "fitted to the shapes measured"
        if prediction.out_of_memory:
            return Refusal(
                "memory", f"{cost.describe()} ran out of memory on {self.device} when it was measured"
            )
        memory, budget = prediction.memory_bytes, self.memory_budget_bytes
        if memory is not None and budget is not None and memory > budget:
            return Refusal(
                "memory",
                f"{cost.describe()} needs {memory / 2**30:.2f} GiB for activations on {self.device} ({where}); "
                f"{budget / 2**30:.2f} GiB are free for them",
            )
        if prediction.seconds > self.time_budget_s:
            return Refusal(
                "time",
                f"{cost.describe()} takes {prediction.seconds:.0f} s on {self.device} ({where}), "
                f"more than the request timeout of {self.time_budget_s:g} s",
            )
        return None

    def to_json(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "memory_budget_bytes": self.memory_budget_bytes,
            "time_budget_s": self.time_budget_s,
            "adapter_bytes": self.adapter_bytes,
            "measurements": [asdict(m) for m in self.measurements],
        }


class MemoryProbe:
    """Peak memory of one call above what the process held before it: the CUDA allocator's peak, or on the
    CPU the resident high-water mark (reset through /proc/self/clear_refs; None where Linux will not)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._before = 0

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._before = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        return_free_host_memory()
        try:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size
        except OSError:
            self._before = -1
            return
        self._before = resident_memory_bytes() or 0

    def peak_above_start(self) -> int | None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return max(0, torch.cuda.max_memory_allocated(self.device) - self._before)
        if self._before < 0:
            return None
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return max(0, int(line.split()[1]) * 1024 - self._before)
        return None


def free_memory_bytes(device: torch.device, allocator_budget_bytes: int | None) -> int | None:
    """What generations may add on ``device`` now: the CUDA allocator's room (under the --max-memory budget
    where given), or the host's available memory for the CPU."""
    if device.type != "cuda":
        return host_available_bytes()
    allocated = torch.cuda.memory_allocated(device)
    free, _total = torch.cuda.mem_get_info(device)
    room = free + torch.cuda.memory_reserved(device) - allocated
    if allocator_budget_bytes is not None:
        room = min(room, allocator_budget_bytes - allocated)
    return max(0, room)


def _aligned(value: int, align: int) -> int:
    return max(align, value // align * align)


def calibration_shapes(adapter: PipelineAdapter, max_pixels: int) -> list[tuple[int, int, int]]:
    """(side_w, side_h, references) to measure, the largest first: the default size with the most references down
    to none, then half that size with the most references and with none, then a quarter of it with none (all
    within ``max_pixels``)."""
    align = adapter.size_alignment
    width, height = adapter.default_size
    while width * height > max_pixels and min(width, height) > align:
        width, height = _aligned(width // 2, align), _aligned(height // 2, align)
    most = adapter.max_reference_images
    shapes = [(width, height, k) for k in range(most, -1, -1)]
    half = (_aligned(width // 2, align), _aligned(height // 2, align))
    if half != (width, height):
        shapes += [(*half, k) for k in dict.fromkeys((most, 0))]
        quarter = (_aligned(half[0] // 2, align), _aligned(half[1] // 2, align))
        if quarter != half:  # a third size: the seconds' square term (attention) can be told from the line
            shapes.append((*quarter, 0))
    return shapes


def _references(adapter: PipelineAdapter, count: int, width: int, height: int) -> list[Image.Image]:
    """Plain reference pictures of the size the pipeline reads them at (its reference size, else the output's)."""
    side = int(adapter.reference_pixels**0.5) if adapter.reference_pixels else None
    size = (side, side) if side else (width, height)
    return [Image.new("RGB", size, (64 * (i + 1) % 256, 128, 200)) for i in range(count)]


def _measure(adapter: PipelineAdapter, shape: tuple[int, int, int], probe: MemoryProbe) -> Measurement:
    width, height, count = shape
    references = _references(adapter, count, width, height)
    request = GenerationRequest(
        prompt="calibration",
        images=references,
        width=width,
        height=height,
        num_inference_steps=_CALIBRATION_STEPS,
        seed=0,
    )
    probe.start()
    result = adapter(request)
    return Measurement.of(request_cost(request, count, adapter), result, probe.peak_above_start())


def _ran_out(adapter: PipelineAdapter, width: int, height: int, count: int) -> Measurement:
    """What calibration records of a shape that ran out of memory: the shape, and nothing measured."""
    reference_pixels = adapter.reference_pixels or width * height
    return Measurement(width * height, count, reference_pixels, {}, None, None, True)


def _undo_what_bought_nothing(
    adapter: PipelineAdapter,
    device: torch.device,
    allocator_budget_bytes: int | None,
    measurements: list[Measurement],
    chased: dict[tuple[int, int, int], int],
    never: set[tuple[int, int, int]],
) -> bool:
    """A shape the placement was demoted for that ran, but above what the cost model will let a request add:
    refused anyway, it bought nothing with the moves that
    every smaller shape now pays for, so they are undone and it is recorded as out of memory, as a shape out of
    memory with everything moved is (on an H100 under 16 GiB: 4 references ran with every component streamed at
    14.51 GiB above the model, against 11.82 GiB the model allowed, and 0-3 references were served streamed, 1.40-
    1.85x slower). Whether anything was undone."""
    placement = adapter.pipeline.ditq_placement
    budget = free_memory_bytes(device, allocator_budget_bytes)
    if budget is None:
        return False
    for measured in measurements:
        shape = next(
            (s for s in chased if (s[0] * s[1], s[2]) == (measured.pixels, measured.references)), None
        )
        if measured.out_of_memory or shape is None or (measured.memory_bytes or 0) <= budget:
            continue
        never.add(shape)
        undone = placement.restore(adapter.pipeline, chased[shape])
        logger.info(
            "calibration: %dx%d with %d references needs %.2f GiB, more than the %.2f GiB a request may add as "
            "placed for it; %s",
            *shape,
            (measured.memory_bytes or 0) / 2**30,
            budget / 2**30,
            "the placement is put back" if undone else "it is refused",
        )
        return bool(undone)
    return False


def calibrate(
    adapter: PipelineAdapter,
    device: torch.device,
    max_pixels: int,
    time_budget_s: float,
    allocator_budget_bytes: int | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> CostModel:
    """Measure ``calibration_shapes`` (after a warm-up call at the smallest) until ``CALIBRATION_LIMIT_S`` has
    passed. A compiled pipeline (``--compile``) runs each shape once before measuring it, so that no measurement and
    no request pays a compilation; that warm-up is recorded (``CompileFacts.warmup_seconds``) and not held against
    the limit. A shape that runs out of memory makes an ``auto`` placement take its next step, and every shape is
    measured again under the new placement; with nothing left to move it is recorded as out of memory, and the steps
    taken for it are undone (``Placement.restore``) before the rest are measured again: a shape no placement serves
    does not leave the servable ones streamed. So too a shape that runs once moved but above what the model will let
    a request add (``_undo_what_bought_nothing``). The warm-up itself, out of memory as placed, moves the placement
    the same way; with nothing left to move the start fails in one line."""
    started = clock()
    shapes = calibration_shapes(adapter, max_pixels)
    probe = MemoryProbe(device)
    placement = getattr(adapter.pipeline, "ditq_placement", None)
    compiled = getattr(adapter.pipeline, "ditq_compile", None)
    warming = 0.0  # under --compile: the first call at each shape, which compiles; not held against the limit
    warm: set[tuple[int, int, int]] = set()
    graphs_at_start = compiled_graphs()

    def warm_up(shape: tuple[int, int, int]) -> None:
        nonlocal warming
        begun = clock()
        _measure(adapter, shape, probe)
        warming += clock() - begun
        warm.add(shape)

    def measure(shape: tuple[int, int, int], into: list[Measurement]) -> None:
        if compiled is not None and shape not in warm:
            warm_up(shape)
        into.append(_measure(adapter, shape, probe))

    logger.info(
        "calibrating the cost model: %d request shapes to time (up to %.0f s) before the server is ready",
        len(shapes),
        CALIBRATION_LIMIT_S,
    )
    # first-call costs (and, compiled, the first compilation); eager, every shape is then measured as it first runs
    smallest = min(shapes, key=lambda s: (s[0] * s[1], s[2]))
    if placement is None:
        runs_out(lambda: warm_up(smallest), catch=False)
    else:
        # the smallest request may not fit as placed (on an H100 under 16 GiB, the BF16 model's streamed text
        # encoder could not bring its 1.16 GiB embedding onto the device beside the resident transformer): the
        # placement takes its next step, as for any shape, rather than the server failing to start
        demote_until_it_runs(
            placement,
            adapter.pipeline,
            lambda: warm_up(smallest),
            f"--max-memory/--offload auto: the smallest request ({smallest[0]}x{smallest[1]}) ran out of memory on "
            f"{device} with everything moved off it: the budget is too small for this model",
        )
    never: set[tuple[int, int, int]] = set()  # shapes out of memory with everything moved off the device
    chased: dict[tuple[int, int, int], int] = {}  # shape -> the placement's steps when it first ran out
    while True:
        measurements: list[Measurement] = []
        demoted = False
        for index, (width, height, count) in enumerate(shapes, 1):
            if (width, height, count) in never:
                measurements.append(_ran_out(adapter, width, height, count))
                continue
            if measurements and clock() - started - warming > CALIBRATION_LIMIT_S:
                logger.info(
                    "calibration: %.0f s spent; the shapes left are priced from the fit", clock() - started
                )
                break
            logger.info(
                "calibration: shape %d of %d, %dx%d with %d references",
                index,
                len(shapes),
                width,
                height,
                count,
            )
            ran_out, failed_stage = runs_out(partial(measure, (width, height, count), measurements))
            if not ran_out:
                continue
            if placement is not None:
                chased.setdefault((width, height, count), len(placement.steps))
                if placement.demote(adapter.pipeline, failed_stage) is not None:
                    demoted = True
                    break
                # nothing left to move: this shape can never run here, and what was moved for it bought
                # nothing; undone, the shapes that fit are measured again where they were (resident)
                never.add((width, height, count))
                if placement.restore(adapter.pipeline, chased[(width, height, count)]):
                    demoted = True
                    logger.info(
                        "calibration: %dx%d with %d references ran out of memory with everything moved; "
                        "the placement is put back",
                        width,
                        height,
                        count,
                    )
                    break
            logger.info("calibration: %dx%d with %d references ran out of memory", width, height, count)
            measurements.append(_ran_out(adapter, width, height, count))
        if not demoted and placement is not None:
            demoted = _undo_what_bought_nothing(
                adapter, device, allocator_budget_bytes, measurements, chased, never
            )
        if not demoted:
            break
        warm.clear()  # a new placement: compiled code may differ (streamed weights), warm every shape again
    if compiled is not None:
        compiled.warmed_up(warming, graphs_at_start)
        logger.info("compiled with %s: %d shape(s) warmed up in %.1f s", compiled.backend, len(warm), warming)
    model = CostModel(
        device=str(device),
        measurements=measurements,
        memory_budget_bytes=free_memory_bytes(device, allocator_budget_bytes),
        time_budget_s=time_budget_s,
        adapter_bytes=adapter.lora.parameter_bytes if adapter.lora is not None else 0,
    )
    largest = measurements[0]
    logger.info(
        "cost model on %s: %d shapes measured in %.1f s; at %d px with %d references: %.3f s/step, %s above the "
        "model; %s free for activations",
        device,
        len(measurements),
        clock() - started,
        largest.pixels,
        largest.references,
        largest.seconds.get("step", float("nan")),
        "out of memory" if largest.out_of_memory else f"{(largest.memory_bytes or 0) / 2**30:.2f} GiB",
        "unknown memory"
        if model.memory_budget_bytes is None
        else f"{model.memory_budget_bytes / 2**30:.2f} GiB",
    )
    return model


def request_cost(request: GenerationRequest, references: int, adapter: PipelineAdapter) -> RequestCost:
    """The cost shape of a validated request; 'auto' size and steps are the pipeline's defaults, and a
    reference counts as the pipeline's reference size where it declares one, else as the output's size."""
    width = request.width or adapter.default_size[0]
    height = request.height or adapter.default_size[1]
    return RequestCost(
        pixels=width * height,
        steps=request.num_inference_steps or adapter.default_steps,
        images=request.num_images,
        references=references,
        reference_pixels=adapter.reference_pixels or width * height,
    )
