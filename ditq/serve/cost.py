"""What a request costs the device, measured once at start-up, and the budget it must fit.

A request asks for ``n`` images of ``pixels`` each, every one read together with its ``references``, over
``steps`` denoising steps. Start-up measures one image's step time and peak memory at growing square sizes
(n=1, no references, the pipeline's default guidance; after one warm-up call) until a step takes
``target_step_s``, and keeps the last two sizes. Step time and activation memory grow at least linearly in the pixels of one sequence
(attention grows faster), so the line through the two points, continued past the larger one, is a lower
bound; n images cost n times one image. A request whose lower bound is over the budget can never fit:

- memory: what the device has free for activations after loading (CUDA: the allocator's budget under
  ``--max-memory`` or the device's free memory; the CPU: the host's available memory, cgroup limit included);
- time: the request timeout.

Either is refused with 413 before it is queued: ``over_memory_budget`` (it does not fit this server's memory,
as a request that ran out of it does not: a server with more offload may take it) or ``over_budget`` (time).
The same lower bounds, summed over the queue, say how long a new request would wait at least (429 ``busy``
when that alone passes its deadline).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ditq.runtime.adapter import GenerationRequest, PipelineAdapter
from ditq.serve.metrics import resident_memory_bytes
from ditq.serve.worker import free_accelerator_memory, is_out_of_memory, return_free_host_memory

__all__ = [
    "CostModel",
    "MemoryProbe",
    "Point",
    "Refusal",
    "RequestCost",
    "calibrate",
    "free_memory_bytes",
    "request_cost",
]

logger = logging.getLogger(__name__)

TARGET_STEP_S = 0.1  # calibration stops at the first size whose step takes this long
CALIBRATION_LIMIT_S = 30.0  # ... or once calibrating took this long
_CALIBRATION_STEPS = 3  # the first step may do one-time work (a prefix cache); the fastest later one counts


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
class Point:
    """One calibration measurement: a square image of ``pixels``, n=1."""

    pixels: int
    step_seconds: float
    memory_bytes: int | None  # peak above what was held before the call; None where it cannot be read


def _lower_bound(pixels: int, low_pixels: int, low: float, high_pixels: int, high: float) -> float:
    """A monotone, convex cost measured at two sizes: 0 below the first, the first value up to the second,
    the chord continued past it."""
    if pixels < low_pixels:
        return 0.0
    if pixels < high_pixels:
        return low
    slope = max(0.0, (high - low) / (high_pixels - low_pixels)) if high_pixels > low_pixels else 0.0
    return high + slope * (pixels - high_pixels)


@dataclass(frozen=True)
class CostModel:
    """Lower bounds of a request's run time and peak memory on this device, and the budgets they must fit."""

    device: str
    low: Point
    high: Point
    memory_budget_bytes: int | None  # free for activations after loading; None: unknown (not enforced)
    time_budget_s: float  # the request timeout

    def seconds(self, cost: RequestCost) -> float:
        per_step = _lower_bound(
            cost.sequence_pixels,
            self.low.pixels,
            self.low.step_seconds,
            self.high.pixels,
            self.high.step_seconds,
        )
        return cost.steps * cost.images * per_step

    def memory_bytes(self, cost: RequestCost) -> int | None:
        if self.low.memory_bytes is None or self.high.memory_bytes is None:
            return None
        per_image = _lower_bound(
            cost.sequence_pixels,
            self.low.pixels,
            self.low.memory_bytes,
            self.high.pixels,
            self.high.memory_bytes,
        )
        return int(cost.images * per_image)

    def refusal(self, cost: RequestCost) -> Refusal | None:
        """Why the request can never fit (memory first), or None."""
        memory = self.memory_bytes(cost)
        if memory is not None and self.memory_budget_bytes is not None and memory > self.memory_budget_bytes:
            return Refusal(
                "memory",
                f"{cost.describe()} needs at least {memory / 2**30:.2f} GiB for activations on {self.device}; "
                f"{self.memory_budget_bytes / 2**30:.2f} GiB are free for them",
            )
        seconds = self.seconds(cost)
        if seconds > self.time_budget_s:
            return Refusal(
                "time",
                f"{cost.describe()} takes at least {seconds:.0f} s on {self.device}, "
                f"more than the request timeout of {self.time_budget_s:g} s",
            )
        return None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


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


def _host_available_bytes() -> int | None:
    """MemAvailable, or less where this process's cgroup (v2) allows less."""
    try:
        meminfo = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    available = next(
        (int(line.split()[1]) * 1024 for line in meminfo.splitlines() if line.startswith("MemAvailable:")),
        None,
    )
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        current = int(Path("/sys/fs/cgroup/memory.current").read_text())
    except (OSError, ValueError):
        return available
    if limit.isdigit() and available is not None:
        return min(available, int(limit) - current)
    return available


def free_memory_bytes(device: torch.device, allocator_budget_bytes: int | None) -> int | None:
    """What generations may add on ``device`` now: the CUDA allocator's room (under the --max-memory budget
    where given), or the host's available memory for the CPU."""
    if device.type != "cuda":
        return _host_available_bytes()
    allocated = torch.cuda.memory_allocated(device)
    free, _total = torch.cuda.mem_get_info(device)
    room = free + torch.cuda.memory_reserved(device) - allocated
    if allocator_budget_bytes is not None:
        room = min(room, allocator_budget_bytes - allocated)
    return max(0, room)


def _measure(adapter: PipelineAdapter, side: int, probe: MemoryProbe) -> Point:
    request = GenerationRequest(
        prompt="calibration", width=side, height=side, num_inference_steps=_CALIBRATION_STEPS, seed=0
    )
    probe.start()
    result = adapter(request)
    steps = result.step_times[1:] or result.step_times
    seconds = min(steps) if steps else result.timings["total"] / _CALIBRATION_STEPS
    return Point(side * side, seconds, probe.peak_above_start())


def calibrate(
    adapter: PipelineAdapter,
    device: torch.device,
    max_pixels: int,
    time_budget_s: float,
    allocator_budget_bytes: int | None = None,
    target_step_s: float = TARGET_STEP_S,
    clock: Callable[[], float] = time.perf_counter,
) -> CostModel:
    """Measure squares from 64 px a side, doubling, until a step takes ``target_step_s`` (or the sizes reach
    ``max_pixels``), at least two sizes; running out of memory ends the climb at the last size that fitted."""
    align = adapter.size_alignment
    side = max(align, -(-64 // align) * align)
    probe = MemoryProbe(device)
    if side * side <= max_pixels:
        _measure(
            adapter, side, probe
        )  # warm-up: first-call costs (kernel selection, caches) are not the cost
    started = clock()
    points: list[Point] = []
    while side * side <= max_pixels:
        try:
            points.append(_measure(adapter, side, probe))
        except Exception as error:
            if not points or not is_out_of_memory(error):
                raise
            logger.info("calibration: %dx%d ran out of memory; the climb stops there", side, side)
            break
        finally:
            free_accelerator_memory()
        enough = points[-1].step_seconds >= target_step_s or clock() - started > CALIBRATION_LIMIT_S
        if enough and len(points) >= 2:
            break
        side *= 2
    if not points:
        raise ValueError(f"calibration: the smallest size {side}x{side} is above max_pixels {max_pixels}")
    low, high = (points[-2], points[-1]) if len(points) > 1 else (points[0], points[0])
    model = CostModel(
        device=str(device),
        low=low,
        high=high,
        memory_budget_bytes=free_memory_bytes(device, allocator_budget_bytes),
        time_budget_s=time_budget_s,
    )
    logger.info(
        "cost model on %s: %.4f s/step at %d px, %.4f s/step at %d px; %s free for activations",
        device,
        low.step_seconds,
        low.pixels,
        high.step_seconds,
        high.pixels,
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
