"""A process's budget on one CUDA device (``--max-memory``): what the caching allocator may hold once the CUDA
context and the libraries' own memory are taken off, so the capacity of a smaller card can be tested on a larger
one. The opener applies it before it loads (``ditq.pipeline.open``), and the placement fits within it."""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ditq.devices import parse_memory_size, resolve_device
from ditq.errors import InputError

__all__ = ["ALLOCATOR_ENV", "MemoryCap", "apply_memory_cap", "expandable_segments"]

logger = logging.getLogger(__name__)

ALLOCATOR_ENV = "PYTORCH_CUDA_ALLOC_CONF"
EXPANDABLE = "expandable_segments:True"


@dataclass(frozen=True)
class MemoryCap:
    """A process budget on one CUDA device: what the allocator may hold, after what lives outside it."""

    device: str  # with its index, e.g. cuda:1
    budget_bytes: int  # --max-memory: everything this process may hold on the device
    outside_allocator_bytes: int  # CUDA context and libraries, measured at start-up
    allocator_bytes: int  # the caching allocator's cap: budget - outside
    device_total_bytes: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _process_bytes_on(device: torch.device) -> int | None:
    """This process's memory on ``device`` as the driver counts it (NVML), or None where it cannot say."""
    try:
        import pynvml

        pynvml.nvmlInit()
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        handle = next(
            pynvml.nvmlDeviceGetHandleByIndex(i)
            for i in range(pynvml.nvmlDeviceGetCount())
            if str(pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))).endswith(uuid)
        )
        for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if process.pid == os.getpid() and process.usedGpuMemory is not None:
                return int(process.usedGpuMemory)
    except Exception:  # no NVML, another driver, a sandbox that hides processes: the caller falls back
        return None
    return None


def apply_memory_cap(max_memory: str | None, device: str) -> MemoryCap | None:
    """Cap what this process holds on a CUDA device at ``max_memory`` (e.g. '24GiB'), so the capacity of a
    smaller card can be tested on a larger one.

    The budget covers the whole process as the driver counts it: the CUDA context and the libraries' own
    memory (measured here, after one cuBLAS call, through NVML; where NVML cannot see this process, the
    device's used memory is taken, which also counts other processes and so errs on the safe side) are
    taken off, and the caching allocator gets the rest (``torch.cuda.set_per_process_memory_fraction``).
    An allocation past it raises ``torch.OutOfMemoryError`` like a full card would.
    """
    if max_memory is None:
        return None
    size = parse_memory_size(max_memory)
    torch_device = resolve_device(device)
    if torch_device.type != "cuda":
        raise InputError(f"--max-memory caps accelerator memory; device '{device}' has none to cap")
    if torch_device.index is None:  # the budget is per device: name the current one
        torch_device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(torch_device)
    warm = torch.ones(64, 64, device=torch_device)
    torch.matmul(warm, warm)  # the context and cuBLAS's handle exist from here on
    torch.cuda.synchronize(torch_device)
    reserved = torch.cuda.memory_reserved(torch_device)
    free, total = torch.cuda.mem_get_info(torch_device)
    process = _process_bytes_on(torch_device)
    outside = (process if process is not None else total - free) - reserved
    allowed = size - max(outside, 0)
    if allowed <= 0:
        raise InputError(
            f"--max-memory {max_memory}: the CUDA context alone holds {outside / 2**30:.2f} GiB on {torch_device}"
        )
    torch.cuda.set_per_process_memory_fraction(min(1.0, allowed / total), torch_device)
    cap = MemoryCap(str(torch_device), size, max(outside, 0), allowed, total)
    logger.info(
        "accelerator memory capped at %.2f GiB on %s: %.2f GiB for tensors, %.2f GiB held by the CUDA context "
        "and libraries (%s)",
        size / 2**30,
        torch_device,
        allowed / 2**30,
        max(outside, 0) / 2**30,
        "this process, NVML" if process is not None else "whole device",
    )
    return cap


def expandable_segments(device: torch.device, managed: bool) -> str | None:
    """Where ditq fits the model to the device's memory (``managed``: ``--offload auto`` or ``--max-memory``) on
    CUDA, the caching allocator grows segments in place (``expandable_segments``) instead of carving requests out
    of fixed ones, unless the environment already configures it (``PYTORCH_CUDA_ALLOC_CONF``, which wins). Under a
    budget, memory reserved but unallocated between fixed segments ran requests out that fit: on an H100 under
    16 GiB a 3-reference w4a8 request that calibration had measured inside the budget ran out with 2.82 GiB so
    held, with the cache emptied before each request too, and was served with expandable segments
    (``benchmarks/results/h100-four-bit/``, runs 5 and 6). What is in force: ``expandable_segments`` (set here),
    ``environment: ...`` (the user's), or None (not CUDA, or not managed)."""
    if device.type != "cuda" or not managed:
        return None
    configured = os.environ.get(ALLOCATOR_ENV)
    if configured:
        return f"environment: {configured}"
    # the environment variable is read when the allocator starts; the setter also reaches a started one
    os.environ[ALLOCATOR_ENV] = EXPANDABLE
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is not None and torch.cuda.is_initialized():
        setter(EXPANDABLE)
    logger.info(
        "the CUDA allocator grows its segments in place (%s): the placement fits a budget", EXPANDABLE
    )
    return "expandable_segments"
