"""One generation worker per device: a thread that runs queued requests first in, first out.

The HTTP side submits a :class:`Job` and awaits its future. A job whose client gave up (timeout or
disconnect) is cancelled: while still queued it is removed and never runs; once running it finishes
(a diffusers call cannot be interrupted between steps through the adapter) and its result is dropped.
"""

from __future__ import annotations

import collections
import ctypes
import gc
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from ditq.runtime.adapter import GenerationRequest, GenerationResult, PipelineAdapter

__all__ = ["GenerationWorker", "Job", "OutOfMemory", "QueueClosed", "QueueFull", "is_out_of_memory"]

logger = logging.getLogger(__name__)


class QueueFull(Exception):
    """The bounded queue holds ``max_queue`` waiting jobs already."""


class QueueClosed(Exception):
    """The worker is draining or stopped and takes no new jobs."""


class OutOfMemory(Exception):
    """The accelerator ran out of memory during a generation; memory has been freed since."""


@dataclass
class Job:
    request: GenerationRequest
    enqueued_at: float = field(default_factory=time.perf_counter)
    started_at: float | None = None
    finished_at: float | None = None
    future: Future[GenerationResult] = field(default_factory=Future)

    @property
    def queue_wait_s(self) -> float:
        return (self.started_at or time.perf_counter()) - self.enqueued_at


def is_out_of_memory(error: BaseException) -> bool:
    """An accelerator allocation that failed: torch's OutOfMemoryError, or a library's RuntimeError that says
    so (cuBLAS or a Triton launch asking for workspace past the budget)."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and "out of memory" in str(error).lower()


def free_accelerator_memory() -> None:
    """Drop what a failed generation left behind (tensors held by its frames, the CUDA cache)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _libc_malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None on another C library."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _libc_malloc_trim()


def return_free_host_memory() -> None:
    """Hand the heap's free pages back to the OS. A generation allocates and frees hundreds of MB
    of activations of request-dependent sizes; glibc keeps the freed pages, and without this the
    resident size of a long-running server creeps up with fragmentation although nothing is live."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


class GenerationWorker:
    """A FIFO of at most ``max_queue`` waiting jobs in front of one adapter, served by one thread."""

    def __init__(self, adapter: PipelineAdapter, max_queue: int, name: str = "generation-worker") -> None:
        self.adapter = adapter
        self.max_queue = max_queue
        self._waiting: collections.deque[Job] = collections.deque()
        self._lock = threading.Condition()
        self._running: Job | None = None
        self._closed = False
        self.finished = 0  # run to the end, successfully or not
        self.dropped = 0  # cancelled while queued: never run
        self.oom_count = 0
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def queue_depth(self) -> int:
        """Jobs waiting, not counting the one being generated."""
        with self._lock:
            return len(self._waiting)

    @property
    def busy(self) -> bool:
        with self._lock:
            return self._running is not None

    def submit(self, request: GenerationRequest) -> Job:
        with self._lock:
            if self._closed:
                raise QueueClosed
            if len(self._waiting) >= self.max_queue:
                raise QueueFull
            job = Job(request)
            self._waiting.append(job)
            self._lock.notify_all()
            return job

    def cancel(self, job: Job) -> bool:
        """Withdraw a job; True when it was still queued (it will never run)."""
        with self._lock:
            if job in self._waiting:
                self._waiting.remove(job)
                job.future.cancel()
                self.dropped += 1
                self._lock.notify_all()
                return True
            return False

    def close(self, timeout: float | None = None) -> bool:
        """Take no new jobs, finish the queued and running ones, stop the thread; True when drained."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _next(self) -> Job | None:
        with self._lock:
            while not self._waiting and not self._closed:
                self._lock.wait()
            if not self._waiting:
                return None  # closed and drained
            job = self._waiting.popleft()
            job.future.set_running_or_notify_cancel()
            self._running = job
            return job

    def _loop(self) -> None:
        while (job := self._next()) is not None:
            job.started_at = time.perf_counter()
            out_of_memory = False
            try:
                job.future.set_result(self.adapter(job.request))
            except Exception as error:  # reported to the client; the worker carries on
                if is_out_of_memory(error):
                    out_of_memory = True
                    logger.error(
                        "out of accelerator memory: %s", str(error).splitlines()[0] if str(error) else ""
                    )
                    job.future.set_exception(OutOfMemory("out of accelerator memory"))
                else:
                    job.future.set_exception(error)
            if out_of_memory:
                # Outside the except block: the traceback (and the tensors its frames hold) is gone.
                self.oom_count += 1
                free_accelerator_memory()
            return_free_host_memory()
            job.finished_at = time.perf_counter()
            with self._lock:
                self._running = None
                self.finished += 1
