"""One generation worker per device: a thread that runs queued requests first in, first out.

The HTTP side submits a :class:`Job` and awaits its future. A job whose client gave up (timeout or
disconnect) is cancelled: while still queued it is removed and never runs; once running it is stopped
at the next denoising step (the adapter asks :meth:`Job.stop_reason` after every step) and fails with
:class:`Cancelled`. A job past its deadline stops the same way without being asked. Uploaded references
are decoded here, just before the run, so a queued job holds only their compressed bytes.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Literal

from ditq.errors import error_line
from ditq.runtime.adapter import GenerationCancelled, GenerationRequest, GenerationResult, PipelineAdapter
from ditq.runtime.memory import free_accelerator_memory, is_out_of_memory, return_free_host_memory
from ditq.serve.intake import Reference, decode_references
from ditq.serve.metrics import resident_memory_bytes

__all__ = [
    "Cancelled",
    "GenerationWorker",
    "Job",
    "OutOfMemory",
    "QueueClosed",
    "QueueFull",
    "RankLost",
    "StopReason",
    "is_out_of_memory",
]

logger = logging.getLogger(__name__)

# Why a job stopped early: its client left, its deadline passed, the server drains, or (on the CPU, where
# nothing raises) the process's resident memory went past the budget.
StopReason = Literal["client_gone", "timeout", "draining", "out_of_memory"]


class QueueFull(Exception):
    """The bounded queue holds ``max_queue`` waiting jobs already."""


class QueueClosed(Exception):
    """The worker is draining or stopped and takes no new jobs."""


class OutOfMemory(Exception):
    """The accelerator ran out of memory during a generation; memory has been freed since."""


class RankLost(Exception):
    """A parallel server's ranks are no longer in step (one exited, or a generation failed on one of them); the
    message says which rank and why (``ditq.serve.ranks``)."""


class Cancelled(Exception):
    """The job stopped before its end (between two denoising steps, or before it ran)."""

    def __init__(self, reason: StopReason, steps_done: int = 0) -> None:
        super().__init__(f"{reason} after {steps_done} steps")
        self.reason: StopReason = reason
        self.steps_done = steps_done


@dataclass(eq=False)
class Job:
    request: GenerationRequest
    references: tuple[Reference, ...] = ()  # decoded by the worker into request.images
    deadline: float | None = None  # time.perf_counter() after which the job stops
    estimate_s: float = 0.0  # a lower bound of its run time (0: unknown); for the queue's wait estimate
    enqueued_at: float = field(default_factory=time.perf_counter)
    started_at: float | None = None
    finished_at: float | None = None
    future: Future[GenerationResult] = field(default_factory=Future)
    stop_requested: StopReason | None = None  # set from the event loop, read by the worker between steps
    stop_requested_at: float | None = None

    @property
    def queue_wait_s(self) -> float:
        return (self.started_at or time.perf_counter()) - self.enqueued_at

    def request_stop(self, reason: StopReason) -> None:
        if self.stop_requested is None:
            self.stop_requested, self.stop_requested_at = reason, time.perf_counter()

    def stop_reason(self) -> StopReason | None:
        if self.stop_requested is None and self.deadline is not None and time.perf_counter() > self.deadline:
            self.request_stop("timeout")
        return self.stop_requested


class GenerationWorker:
    """A FIFO of at most ``max_queue`` waiting jobs in front of one adapter, served by one thread.

    ``resident_limit_bytes`` (host generations): a running job stops as ``out_of_memory`` once the process's
    resident memory passes it, checked between steps, since the CPU has no allocator that raises.
    ``between_jobs``: called after every job, before the next starts (on CUDA, emptying the allocator's cache: each
    request then starts from the state the cost model measured its shape in).
    """

    def __init__(
        self,
        adapter: PipelineAdapter,
        max_queue: int,
        name: str = "generation-worker",
        resident_limit_bytes: int | None = None,
        between_jobs: Callable[[], None] | None = None,
    ) -> None:
        self.adapter = adapter
        self.max_queue = max_queue
        self.resident_limit_bytes = resident_limit_bytes
        self.between_jobs = between_jobs
        self._waiting: collections.deque[Job] = collections.deque()
        self._lock = threading.Condition()
        self._running: Job | None = None
        self._closed = False
        self.finished = 0  # run to the end, successfully or not
        self.dropped = 0  # cancelled while queued: never run
        self.stopped = 0  # stopped between steps while running
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

    @property
    def running(self) -> Job | None:
        with self._lock:
            return self._running

    @property
    def idle(self) -> bool:
        """Nothing running, nothing waiting."""
        with self._lock:
            return self._running is None and not self._waiting

    def estimated_wait_s(self) -> float:
        """A lower bound of the seconds before a job submitted now starts: the queued jobs' estimates plus
        what the running one has left of its own."""
        now = time.perf_counter()
        with self._lock:
            running = self._running
            ahead = sum(job.estimate_s for job in self._waiting)
        if running is not None and running.started_at is not None:
            ahead += max(0.0, running.estimate_s - (now - running.started_at))
        return ahead

    def submit(
        self,
        request: GenerationRequest,
        references: tuple[Reference, ...] = (),
        deadline: float | None = None,
        estimate_s: float = 0.0,
    ) -> Job:
        with self._lock:
            if self._closed:
                raise QueueClosed
            if len(self._waiting) >= self.max_queue:
                raise QueueFull
            job = Job(request, references, deadline, estimate_s)
            self._waiting.append(job)
            self._lock.notify_all()
            return job

    def cancel(self, job: Job, reason: StopReason = "client_gone") -> bool:
        """Withdraw a job; True when it was still queued (it will never run). A running job is asked to stop
        at its next denoising step and fails with :class:`Cancelled`."""
        with self._lock:
            if job in self._waiting:
                self._waiting.remove(job)
                job.future.set_exception(Cancelled(reason))
                self.dropped += 1
                self._lock.notify_all()
                return True
            if job is self._running:
                job.request_stop(reason)
            return False

    def cancel_all(self, reason: StopReason) -> None:
        """Every queued job withdrawn and the running one asked to stop (a drain that ran out of time)."""
        with self._lock:
            jobs = [*self._waiting, *([self._running] if self._running is not None else [])]
        for job in jobs:
            self.cancel(job, reason)

    def close(self, timeout: float | None = None) -> bool:
        """Take no new jobs, finish the queued and running ones, stop the thread; True when drained."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _stop_reason(self, job: Job) -> StopReason | None:
        reason = job.stop_reason()
        if reason is None and self.resident_limit_bytes is not None:
            resident = resident_memory_bytes()
            if resident is not None and resident > self.resident_limit_bytes:
                job.request_stop("out_of_memory")
                reason = job.stop_requested
        return reason

    def _next(self) -> Job | None:
        with self._lock:
            while not self._waiting and not self._closed:
                self._lock.wait()
            if not self._waiting:
                return None  # closed and drained
            job = self._waiting.popleft()
            job.future.set_running_or_notify_cancel()
            job.started_at = time.perf_counter()
            self._running = job
            return job

    def _run(self, job: Job) -> GenerationResult:
        if (reason := job.stop_reason()) is not None:  # past its deadline before it started
            raise Cancelled(reason)
        images = decode_references(job.references) if job.references else job.request.images
        request = dataclasses.replace(job.request, images=images, should_stop=lambda: self._stop_reason(job))
        try:
            return self.adapter(request)
        except GenerationCancelled as cancelled:
            raise Cancelled(job.stop_requested or "timeout", cancelled.steps_done) from None

    def _loop(self) -> None:
        while (job := self._next()) is not None:
            out_of_memory = False
            try:
                job.future.set_result(self._run(job))
            except Exception as error:  # reported to the client; the worker carries on
                if isinstance(error, Cancelled):
                    self.stopped += 1
                    out_of_memory = error.reason == "out_of_memory"
                    logger.log(
                        logging.ERROR if out_of_memory else logging.INFO, "generation stopped: %s", error
                    )
                    job.future.set_exception(error)
                elif is_out_of_memory(error):
                    out_of_memory = True
                    logger.error("out of accelerator memory: %s", error_line(error))
                    job.future.set_exception(OutOfMemory("out of accelerator memory"))
                else:
                    job.future.set_exception(error)
            if out_of_memory:
                # Outside the except block: the traceback (and the tensors its frames hold) is gone.
                self.oom_count += 1
                free_accelerator_memory()
            elif self.between_jobs is not None:
                self.between_jobs()
            return_free_host_memory()
            job.finished_at = time.perf_counter()
            with self._lock:
                self._running = None
                self.finished += 1
