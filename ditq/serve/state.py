"""The server's lifecycle: loading -> ready (or failed) -> draining, and what each phase allows."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from ditq.gate import load_rules
from ditq.runtime.adapter import PipelineAdapter
from ditq.serve import errors
from ditq.serve.config import ServeConfig
from ditq.serve.errors import APIError
from ditq.serve.metrics import ServerMetrics
from ditq.serve.worker import GenerationWorker, is_out_of_memory

__all__ = ["DoctorOutcome", "Phase", "ServerState"]

logger = logging.getLogger(__name__)

Phase = Literal["loading", "ready", "failed", "draining", "stopped"]


@dataclass(frozen=True)
class DoctorOutcome:
    """The start-up kernel check: passed, or why not. ``status`` is passed/failed/skipped."""

    status: Literal["passed", "failed", "skipped"]
    summary: str

    @property
    def allows_serving(self) -> bool:
        return self.status != "failed"


class ServerState:
    """Owns the adapter and the worker once loading finished; the HTTP layer only asks it questions."""

    def __init__(
        self,
        config: ServeConfig,
        load: Callable[[], PipelineAdapter],
        doctor: Callable[[PipelineAdapter], DoctorOutcome],
        model_root: str,
        on_load_failure: Callable[[str, bool], None] | None = None,
        facts: dict[str, Any] | None = None,
    ) -> None:
        self.config = config
        # What /health tells a client about this server beyond its phase: device, offload, memory budget
        # (set by the caller), then load time and kernel paths (set once loaded).
        self.facts: dict[str, Any] = dict(facts or {})
        self.metrics = ServerMetrics()
        self.gate_rules = load_rules()  # the collapse signatures a returned image must not show
        self.model_root = model_root
        self.phase: Phase = "loading"
        self.adapter: PipelineAdapter | None = None
        self.worker: GenerationWorker | None = None
        self.doctor_outcome: DoctorOutcome | None = None
        self.failure: str | None = None
        self.out_of_memory_at_load = False
        self.loaded_at: int | None = None
        self._load = load
        self._doctor = doctor
        self.on_load_failure = on_load_failure
        self._loader = threading.Thread(target=self._load_and_check, name="model-loader", daemon=True)
        self.metrics.add_gauge(
            "ditq_model_ready",
            "1 when the model is loaded and the doctor passed.",
            lambda: 1 if self.phase == "ready" else 0,
        )
        self.metrics.add_gauge(
            "ditq_queue_depth",
            "Requests waiting for the generation worker.",
            lambda: self.worker.queue_depth if self.worker else 0,
        )
        self.metrics.add_gauge(
            "ditq_generation_running",
            "1 while a generation runs.",
            lambda: int(self.worker.busy) if self.worker else 0,
        )
        self.metrics.add_gauge(
            "ditq_out_of_memory_total",
            "Generations that ran out of accelerator memory.",
            lambda: self.worker.oom_count if self.worker else 0,
            kind="counter",
        )
        self.metrics.add_gauge(
            "ditq_dropped_requests_total",
            "Queued requests dropped before running (client gone or timed out).",
            lambda: self.worker.dropped if self.worker else 0,
            kind="counter",
        )

    def start(self) -> None:
        self._loader.start()

    def wait_loaded(self, timeout: float | None = None) -> bool:
        self._loader.join(timeout)
        return not self._loader.is_alive()

    def _load_and_check(self) -> None:
        started = time.perf_counter()
        try:
            adapter = self._load()
            loaded_s = time.perf_counter() - started
            outcome = self._doctor(adapter)
        except Exception as error:  # reported by /health and the load-failure callback
            logger.exception("loading %s failed", self.model_root)
            first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
            if is_out_of_memory(error):
                self._fail(f"loading {self.model_root} ran out of accelerator memory: {first_line}", True)
            else:
                self._fail(f"loading {self.model_root} failed: {first_line}")
            return
        from ditq.runtime.generate import pipeline_summary

        _, kernels = pipeline_summary(adapter.pipeline)
        self.facts.update(
            adapter.load_facts,
            load_seconds=round(loaded_s, 3),
            ready_seconds=round(time.perf_counter() - started, 3),  # load + the doctor's check
            kernel_paths=kernels,
        )
        self.adapter, self.doctor_outcome = adapter, outcome
        if not outcome.allows_serving:
            self._fail(f"the kernel doctor failed: {outcome.summary}")
            return
        self.worker = GenerationWorker(adapter, self.config.max_queue)
        self.loaded_at = int(time.time())
        if self.phase == "loading":
            self.phase = "ready"
        logger.info(
            "model %s ready in %.1f s (doctor: %s)",
            self.config.served_model_name,
            time.perf_counter() - started,
            outcome.status,
        )

    def _fail(self, message: str, out_of_memory: bool = False) -> None:
        self.failure = message
        self.out_of_memory_at_load = out_of_memory
        self.phase = "failed"
        if self.on_load_failure is not None:
            self.on_load_failure(message, out_of_memory)

    def begin_drain(self) -> None:
        """Refuse new requests from now on; queued and running ones still finish."""
        if self.phase in ("loading", "ready"):
            logger.info(
                "draining: no new requests; finishing %d queued and running",
                (self.worker.queue_depth + int(self.worker.busy)) if self.worker else 0,
            )
            self.phase = "draining"

    def stop(self, timeout: float | None = None) -> None:
        self.begin_drain()
        if self.worker is not None and not self.worker.close(timeout):
            logger.warning("the generation worker did not finish within %s s", timeout)
        self.phase = "stopped"

    def require_ready(self) -> GenerationWorker:
        """The worker, or the 503 that says why requests are not taken now."""
        if self.phase == "ready" and self.worker is not None:
            return self.worker
        if self.phase == "loading":
            raise errors.loading()
        if self.phase == "failed":
            raise APIError(
                503, self.failure or "the model failed to load", type="server_error", code="model_unavailable"
            )
        raise errors.draining()
