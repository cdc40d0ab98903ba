"""The server's lifecycle: loading -> ready (or failed) -> draining, what each phase allows, and /health.

Ready is reported as one of three states: ``ready`` (idle), ``busy`` (generating or requests queued; still
200) and ``degraded`` (503: a generation was asked to stop, by its deadline or its client, and is still
running ``OVERDUE_GRACE_S`` later, so the worker is wedged until it ends; or a parallel server lost a rank,
``ditq.serve.ranks``, and serves nothing until it restarts).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from ditq.errors import DitqError, error_line
from ditq.runtime.adapter import PipelineAdapter
from ditq.runtime.memory import empty_accelerator_cache, is_out_of_memory
from ditq.serve import errors
from ditq.serve.config import ServeConfig
from ditq.serve.cost import CostModel
from ditq.serve.errors import APIError
from ditq.serve.metrics import ServerMetrics, resident_memory_bytes
from ditq.serve.worker import GenerationWorker
from ditq.signatures import load_rules

__all__ = ["OVERDUE_GRACE_S", "DoctorOutcome", "Phase", "Ranks", "ServerState"]

logger = logging.getLogger(__name__)

Phase = Literal["loading", "ready", "failed", "draining", "stopped"]
OVERDUE_GRACE_S = 10.0  # a generation asked to stop that still runs this much later makes /health degraded


@dataclass(frozen=True)
class DoctorOutcome:
    """The start-up kernel check: passed, or why not. ``status`` is passed/failed/skipped."""

    status: Literal["passed", "failed", "skipped"]
    summary: str

    @property
    def allows_serving(self) -> bool:
        return self.status != "failed"


class Ranks(Protocol):
    """A parallel server's ranks (``ditq.serve.ranks.RankGroup``) as the lifecycle reads them."""

    @property
    def lost(self) -> str | None: ...  # why the ranks can serve no more; None while they can


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
        calibrate: Callable[[PipelineAdapter], CostModel] | None = None,
        ranks: Ranks | None = None,
    ) -> None:
        self.config = config
        self.ranks = ranks
        # What /health tells a client about this server beyond its phase: device, offload, memory budget
        # (set by the caller), then load time and kernel paths (set once loaded).
        self.facts: dict[str, Any] = dict(facts or {})
        self.metrics = ServerMetrics()
        self.gate_rules = load_rules()  # the collapse signatures a returned image must not show
        self.model_root = model_root
        self.phase: Phase = "loading"
        # then "checking kernels", then "calibrating": the log says where a stop signal came
        self.startup_step = "loading"
        self.adapter: PipelineAdapter | None = None
        self.worker: GenerationWorker | None = None
        self.doctor_outcome: DoctorOutcome | None = None
        self.failure: str | None = None
        self.out_of_memory_at_load = False
        self.loaded_at: int | None = None
        self.cost_model: CostModel | None = None  # None: requests are not admitted by cost
        self._load = load
        self._doctor = doctor
        self._calibrate = calibrate
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
        self.metrics.add_gauge(
            "ditq_stopped_generations_total",
            "Running generations stopped between steps (client gone, deadline, drain, memory).",
            lambda: self.worker.stopped if self.worker else 0,
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
            logger.info(
                "loading %s: reading its weights, choosing each quantized layer's kernel", self.model_root
            )
            adapter = self._load()
            loaded_s = time.perf_counter() - started
            logger.info("loaded in %.1f s; the kernel doctor is recording its choices", loaded_s)
            self.startup_step = "checking kernels"
            outcome = self._doctor(adapter)
        except Exception as error:  # reported by /health and the load-failure callback
            first_line = error_line(error) or type(error).__name__
            # one line in the log whatever failed (bad input, a refused scale, a library's own error); the
            # traceback only with --verbose
            logger.error("loading %s failed: %s", self.model_root, first_line)
            logger.debug("loading %s failed", self.model_root, exc_info=not isinstance(error, DitqError))
            out_of_memory = is_out_of_memory(error)
            what = "ran out of accelerator memory" if out_of_memory else "failed"
            # /health says what failed without the message, which may name local paths; the log and the
            # command's exit message have it whole.
            self._fail(
                f"loading {self.model_root} {what}: {first_line}",
                out_of_memory,
                public=f"loading the model {what} ({type(error).__name__}); the server log has the details",
            )
            return
        from ditq.runtime.loader import pipeline_summary

        quantized, kernels = pipeline_summary(adapter.pipeline)
        self.facts.update(
            adapter.load_facts,
            load_seconds=round(loaded_s, 3),
            ready_seconds=round(time.perf_counter() - started, 3),  # load + the doctor's check
            quantized=quantized,
            kernel_paths=kernels,
        )
        self.adapter, self.doctor_outcome = adapter, outcome
        if not outcome.allows_serving:
            self._fail(f"the kernel doctor failed: {outcome.summary}")
            return
        try:
            resident_limit = self._measure_costs(adapter, started)
        except Exception as error:
            logger.exception("calibrating the cost model failed")
            self._fail(
                f"calibrating the cost model failed: {error}",
                is_out_of_memory(error),
                public=f"calibrating the cost model failed ({type(error).__name__})",
            )
            return
        self.facts["cancellable"] = adapter.cancellable
        # on CUDA every request starts from an empty allocator cache, as calibration measured every shape
        between_jobs = (
            empty_accelerator_cache
            if self.cost_model is not None and self.cost_model.device != "cpu"
            else None
        )
        self.worker = GenerationWorker(
            adapter, self.config.max_queue, resident_limit_bytes=resident_limit, between_jobs=between_jobs
        )
        self.loaded_at = int(time.time())
        if self.phase == "loading":
            self.phase = "ready"
        logger.info(
            "model %s ready in %.1f s (doctor: %s)",
            self.config.served_model_name,
            time.perf_counter() - started,
            outcome.status,
        )

    def _measure_costs(self, adapter: PipelineAdapter, started: float) -> int | None:
        """The cost model, where a calibration is given; returns the resident limit for a CPU worker (the host
        has no allocator that raises, so the worker watches the process's resident memory instead)."""
        if self._calibrate is None:
            return None
        self.startup_step = "calibrating"
        calibration_started = time.perf_counter()
        self.cost_model = self._calibrate(adapter)
        self.facts.update(
            calibration_seconds=round(time.perf_counter() - calibration_started, 3),
            cost_model=self.cost_model.to_json(),
            ready_seconds=round(time.perf_counter() - started, 3),
        )
        budget, resident = self.cost_model.memory_budget_bytes, resident_memory_bytes()
        if self.cost_model.device != "cpu" or budget is None or resident is None:
            return None
        return resident + budget

    def _fail(self, message: str, out_of_memory: bool = False, public: str | None = None) -> None:
        """``message`` goes to the load-failure callback (the command's exit message); ``public`` (default:
        the same) to /health and 503 answers."""
        self.failure = public or message
        self.out_of_memory_at_load = out_of_memory
        self.phase = "failed"
        if self.on_load_failure is not None:
            self.on_load_failure(message, out_of_memory)

    def health(self) -> tuple[int, dict[str, Any]]:
        """/health's status code and body."""
        status: str = self.phase
        # a fact that can change while serving (the placement, once calibration demoted it) is shown as it is now
        facts = {k: v.to_json() if hasattr(v, "to_json") else v for k, v in self.facts.items()}
        body: dict[str, Any] = {"model": self.config.served_model_name, **facts}
        worker = self.worker
        if worker is not None:
            running = worker.running
            now = time.perf_counter()
            body["queue_depth"] = worker.queue_depth
            body["estimated_wait_s"] = round(worker.estimated_wait_s(), 3)
            body["running"] = None
            if running is not None:
                overdue_s = now - running.stop_requested_at if running.stop_requested_at is not None else None
                if overdue_s is None and running.deadline is not None and now > running.deadline:
                    overdue_s = now - running.deadline
                body["running"] = {
                    "seconds": round(now - (running.started_at or now), 3),
                    "stop_requested": running.stop_requested,
                    "overdue_seconds": None if overdue_s is None else round(overdue_s, 3),
                }
                if self.phase == "ready":
                    status = "degraded" if overdue_s is not None and overdue_s > OVERDUE_GRACE_S else "busy"
            elif self.phase == "ready" and body["queue_depth"]:
                status = "busy"
        if self.lost is not None and status in ("ready", "busy", "loading"):
            status, body["error"] = "degraded", f"parallel ranks lost: {self.lost}"
        if self.doctor_outcome is not None:
            body["doctor"] = {"status": self.doctor_outcome.status, "summary": self.doctor_outcome.summary}
        if self.failure is not None:
            body["error"] = self.failure
        return (200 if status in ("ready", "busy") else 503), {"status": status, **body}

    @property
    def lost(self) -> str | None:
        """Why a parallel server's ranks can serve no more (None: they can, or the server is not parallel)."""
        return None if self.ranks is None else self.ranks.lost

    @property
    def drained(self) -> bool:
        """Nothing left to finish (or nothing was ever loaded)."""
        return self.worker is None or self.worker.idle

    def begin_drain(self) -> None:
        """Refuse new requests from now on; queued and running ones still finish."""
        if self.phase in ("loading", "ready"):
            logger.info(
                "draining: no new requests; finishing %d queued and running",
                (self.worker.queue_depth + int(self.worker.busy)) if self.worker else 0,
            )
            self.phase = "draining"

    def stop_pending(self) -> None:
        """A drain out of time: every queued request answered 503 draining, the running one stopped at its next
        step."""
        if self.worker is not None:
            self.worker.cancel_all("draining")

    def stop(self, timeout: float | None = None) -> None:
        self.begin_drain()
        if self.worker is not None and not self.worker.close(timeout):
            logger.warning("the generation worker did not finish within %s s", timeout)
        self.phase = "stopped"

    def require_ready(self) -> GenerationWorker:
        """The worker, or the 503 that says why requests are not taken now."""
        if self.lost is not None and self.phase in ("loading", "ready"):
            raise errors.degraded(self.lost)
        if self.phase == "ready" and self.worker is not None:
            return self.worker
        if self.phase == "loading":
            raise errors.loading()
        if self.phase == "failed":
            raise APIError(
                503, self.failure or "the model failed to load", type="server_error", code="model_unavailable"
            )
        raise errors.draining()
