"""Accelerator and host memory after a failed or finished generation: what counts as out of memory, and giving back
what a generation left behind (the CUDA cache, glibc's free heap pages)."""

from __future__ import annotations

import ctypes
import gc
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = [
    "empty_accelerator_cache",
    "free_accelerator_memory",
    "host_available_bytes",
    "is_out_of_memory",
    "return_free_host_memory",
]


def is_out_of_memory(error: BaseException) -> bool:
    """An accelerator allocation that failed: torch's OutOfMemoryError, or a library's RuntimeError that says
    so (cuBLAS or a Triton launch asking for workspace past the budget)."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and "out of memory" in str(error).lower()


def free_accelerator_memory() -> None:
    """Drop what a failed generation left behind (tensors held by its frames, the CUDA cache)."""
    gc.collect()
    empty_accelerator_cache()


def empty_accelerator_cache() -> None:
    """Hand the CUDA caching allocator's unused blocks back to the driver (no garbage collection: after a job that
    finished, its tensors are already gone). What a job leaves reserved but unallocated, split between segments
    still in use, would otherwise carry into the next one, which calibration measured from an empty cache. It does
    not stop a request fragmenting its own allocations: on an H100 under 16 GiB a 3-reference request measured
    inside the budget ran out with 2.82 GiB reserved but unallocated without this call and 2.88 GiB with it; the allocator's
    expandable segments served it (``ditq.runtime.memory_cap.expandable_segments``; benchmarks/results/h100-four-bit/,
    runs 5 and 6)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _libc_malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None on another C library."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _libc_malloc_trim()


def return_free_host_memory() -> None:
    """Hand the heap's free pages back to the OS. A generation allocates and frees hundreds of MB
    of activations of request-dependent sizes; glibc keeps the freed pages, and without this the
    resident size of a long-running server creeps up with fragmentation although nothing is live."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def host_available_bytes() -> int | None:
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
