"""The FastAPI application: the images API, /v1/models, /health and /metrics.

Request path: Host, Origin and API key (access.py: 400/403/401) -> the body streamed under its limit and
timeout (body_limit.py: 413/408) -> parse (415/400) -> check uploads from their headers (400) -> validate
against settings and pipeline (400) -> admit by cost (413 can never fit, 429 busy) -> enqueue (429) ->
wait for the worker, watching the deadline (504) and the client (dropped when gone; a running generation
stops at its next step either way) -> check the images for collapse (500 non_finite_output) -> encode ->
respond with stage metrics. A failure of the server itself is a 500 naming an error id, never the
exception's text.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException

from ditq.errors import InputError
from ditq.runtime.adapter import GenerationRequest, GenerationResult, PipelineAdapter
from ditq.runtime.images import checked_and_encoded
from ditq.serve import errors
from ditq.serve.access import AccessMiddleware
from ditq.serve.body_limit import BodyLimitMiddleware
from ditq.serve.config import ServeConfig
from ditq.serve.cost import CostModel, Prediction, request_cost
from ditq.serve.errors import APIError, envelope
from ditq.serve.intake import Reference, check_uploads
from ditq.serve.metrics import endpoint_label
from ditq.serve.parsing import parse_form, parse_json
from ditq.serve.request_fields import ignored_fields
from ditq.serve.schemas import (
    ImageData,
    ImageRequest,
    ImageResponse,
    ImageUsage,
    ModelCard,
    ModelList,
    StageMetrics,
)
from ditq.serve.state import DoctorOutcome, Ranks, ServerState
from ditq.serve.validation import to_generation_request
from ditq.serve.worker import (
    Cancelled,
    GenerationWorker,
    Job,
    OutOfMemory,
    QueueClosed,
    QueueFull,
    RankLost,
)

__all__ = ["create_app"]

logger = logging.getLogger(__name__)

_DISCONNECT_POLL_S = 0.25
_CLIENT_GONE = 499  # recorded in /metrics for a client that left before its answer (nothing is sent)
_HEADER_CHECKS = anyio.CapacityLimiter(2)  # uploads' headers read off the event loop, two requests at a time


def _input_error(error: InputError) -> APIError:
    """A refusal found while generating (the adapter's, a reference that does not decode) as a 400 naming
    its field."""
    return APIError(400, str(error), param=error.field, code="invalid_value")


def _error_id() -> str:
    return uuid.uuid4().hex[:12]


def _admit(
    state: ServerState,
    worker: GenerationWorker,
    generation: GenerationRequest,
    references: int,
    deadline: float,
) -> Prediction | None:
    """413 when the request cannot fit this device's budget, 429 when the work queued ahead leaves it no time
    before its deadline; otherwise the cost model's prediction (None without a cost model)."""
    model: CostModel | None = state.cost_model
    if model is None:
        return None
    assert state.adapter is not None
    cost = request_cost(generation, references, state.adapter)
    refusal = model.refusal(cost)
    if refusal is not None:
        refuse = errors.over_memory_budget if refusal.budget == "memory" else errors.over_budget
        raise refuse(f"this request can never run here: {refusal.message}")
    prediction = model.predict(cost)
    seconds, wait = prediction.seconds, worker.estimated_wait_s()
    if wait + seconds > deadline - time.perf_counter():
        raise errors.busy(
            f"the queue holds about {wait:.0f} s of work and this request about {seconds:.0f} s: "
            f"it would not finish within the timeout of {state.config.request_timeout_s:g} s; retry later",
            retry_after_s=wait,
        )
    return prediction


def _stopped(cancelled: Cancelled, state: ServerState) -> APIError | None:
    """The answer for a job stopped early; None when its client left (nothing to answer)."""
    if cancelled.reason == "timeout":
        return errors.request_timeout(state.config.request_timeout_s)
    if cancelled.reason == "draining":
        return errors.draining(f"stopped this request after {cancelled.steps_done} steps")
    if cancelled.reason == "out_of_memory":
        return errors.out_of_memory("the process passed its memory budget between two steps")
    return None


async def _wait(
    request: Request, worker: GenerationWorker, state: ServerState, job: Job, deadline: float
) -> GenerationResult | None:
    """The job's result; None when the client left (the job is withdrawn if still queued, stopped at its next
    step if running)."""
    future = asyncio.wrap_future(job.future)
    while not future.done():
        # a rank is gone: the others may wait on it until their collective times out
        if state.lost is not None:
            raise errors.degraded(state.lost)
        remaining = deadline - time.perf_counter()
        if remaining <= 0:
            worker.cancel(job, "timeout")
            raise errors.request_timeout(state.config.request_timeout_s)
        await asyncio.wait({future}, timeout=min(remaining, _DISCONNECT_POLL_S))
        if not future.done() and await request.is_disconnected():
            dropped = worker.cancel(job, "client_gone")
            logger.info(
                "client disconnected; request %s", "dropped from the queue" if dropped else "stopping"
            )
            return None
    try:
        return future.result()
    except Cancelled as cancelled:
        answer = _stopped(cancelled, state)
        if answer is None:
            return None
        raise answer from None
    except OutOfMemory as error:
        raise errors.out_of_memory(str(error)) from None
    except RankLost as error:
        raise errors.degraded(str(error)) from None
    except InputError as error:
        raise _input_error(error) from None
    except Exception:
        error_id = _error_id()
        logger.exception("generation failed [error id %s]", error_id)
        raise errors.server_fault("generation_failed", error_id) from None


def _finish(
    body: ImageRequest,
    generation: GenerationRequest,
    job: Job,
    result: GenerationResult,
    state: ServerState,
    predicted_bytes: int | None = None,
) -> ImageResponse:
    """Collapse check, encoding and the response body; runs in a worker thread (CPU-bound). ``predicted_bytes``:
    the cost model's memory above the resident model, reported as a peak (on top of what the call began with)."""
    started = time.perf_counter()
    warnings: list[str] = []
    checked, encoded = checked_and_encoded(
        result.images, state.gate_rules, body.output_format, body.background, body.output_compression
    )
    for index, reasons in enumerate(checked):
        if reasons:
            state.metrics.count_collapsed()
            detail = f"image {index + 1} of {len(result.images)}: {'; '.join(reasons)}"
            logger.warning("collapsed output (%s) for prompt %r", detail, generation.prompt[:80])
            if state.config.on_collapse == "error":
                raise errors.non_finite_output(detail)
            warnings.append(f"non_finite_output: {detail}")
    encode_s = time.perf_counter() - started
    width, height = result.images[0].size
    metrics = StageMetrics.from_result(
        result,
        queue_wait_s=job.queue_wait_s,
        encode_s=encode_s,
        steps_asked=generation.num_inference_steps,
        every_step=body.return_stage_metrics,
        predicted_peak_bytes=(
            None
            if predicted_bytes is None or result.memory_at_start_bytes is None
            else result.memory_at_start_bytes + predicted_bytes
        ),
    )
    state.metrics.observe_peak_memory(result.peak_memory_bytes)
    ignored = ignored_fields(body)
    state.metrics.count_ignored(ignored)
    # every served request is a measurement, but one that picked fewer LoRA adapters than calibration ran with (all
    # of them) would price its shape below what the next request may ask for
    if state.cost_model is not None and state.adapter is not None and generation.lora is None:
        state.cost_model.observe(request_cost(generation, len(job.references), state.adapter), result)
    return ImageResponse(
        created=int(time.time()),
        data=[ImageData(b64_json=base64.b64encode(data).decode("ascii")) for data in encoded],
        output_format=body.output_format,
        size=f"{width}x{height}",
        background=body.background,
        usage=ImageUsage(
            input_images=len(job.references),
            output_images=len(encoded),
            output_pixels=width * height * len(encoded),
        ),
        metrics=metrics,
        warnings=warnings,
        ignored_fields=ignored,
    )


async def _generate(request: Request, state: ServerState, edits: bool) -> Response:
    deadline = time.perf_counter() + state.config.request_timeout_s
    worker = state.require_ready()
    adapter = state.adapter
    assert adapter is not None
    references: list[Reference] = []
    if edits:
        body, uploads = await parse_form(request, adapter.max_reference_images)
        references = await anyio.to_thread.run_sync(
            check_uploads, uploads, adapter, state.config, limiter=_HEADER_CHECKS
        )
        del uploads
    else:
        body = await parse_json(request)
    generation = to_generation_request(body, adapter, state.config)
    prediction = _admit(state, worker, generation, len(references), deadline)
    try:
        job = worker.submit(
            generation, tuple(references), deadline, prediction.seconds if prediction else 0.0
        )
    except QueueFull:
        raise errors.queue_full(state.config.max_queue) from None
    except QueueClosed:
        raise errors.draining() from None
    del references
    result = await _wait(request, worker, state, job, deadline)
    if result is None:
        return Response(status_code=_CLIENT_GONE)
    predicted = None if prediction is None else prediction.memory_bytes
    # the JSON too in the worker thread: megabytes of base64, which the event loop should not wait on
    answer = await anyio.to_thread.run_sync(
        lambda: _finish(body, generation, job, result, state, predicted).json_bytes()
    )
    return Response(answer, media_type="application/json")


def _images_route(state: ServerState, endpoint: str, edits: bool) -> Callable[[Request], Any]:
    async def route(request: Request) -> Response:
        started = time.perf_counter()
        try:
            response = await _generate(request, state, edits)
        except APIError as error:
            if error.status >= 500:
                logger.warning("%s -> %d %s: %s", endpoint, error.status, error.code, error.message)
            response = error.response()
        except Exception:  # a fault of the server itself, still answered in the envelope, without its text
            error_id = _error_id()
            logger.exception("%s: internal error [error id %s]", endpoint, error_id)
            response = errors.server_fault("internal_error", error_id).response()
        state.metrics.observe_request(endpoint, response.status_code, time.perf_counter() - started)
        return response

    return route


def create_app(
    config: ServeConfig,
    load: Callable[[], PipelineAdapter],
    doctor: Callable[[PipelineAdapter], DoctorOutcome],
    model_root: str,
    on_load_failure: Callable[[str, bool], None] | None = None,
    drain_timeout_s: float | None = None,
    facts: dict[str, Any] | None = None,
    calibrate: Callable[[PipelineAdapter], CostModel] | None = None,
    ranks: Ranks | None = None,
) -> FastAPI:
    """An app that loads its model in the background at start-up (``load``, ``doctor``, then ``calibrate``:
    the cost model requests are admitted by; without it, only the fixed limits apply).

    ``facts`` (device, offload, memory budget...) are shown by /health with the load time and kernel paths.
    ``model_root`` goes to the log only; responses name the model by ``config.served_model_name``. ``ranks``: a
    parallel server's other ranks (``ditq.serve.ranks``), whose loss makes every answer 503 ``degraded``.
    """
    state = ServerState(config, load, doctor, model_root, on_load_failure, facts, calibrate, ranks)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        state.start()
        yield
        await anyio.to_thread.run_sync(state.stop, drain_timeout_s)

    docs = {} if config.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="ditq serve", lifespan=lifespan, **docs)  # type: ignore[arg-type]

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, error: HTTPException) -> JSONResponse:
        """Unknown paths and methods, in the same envelope as every other error."""
        return JSONResponse(
            envelope(str(error.detail), "invalid_request_error", None, None), status_code=error.status_code
        )

    app.state.serve = state

    def on_reject(path: str, status: int, seconds: float) -> None:
        state.metrics.observe_request(endpoint_label(path), status, seconds)

    # Starlette runs the last added outermost: access is checked before a byte of the body is read.
    app.add_middleware(BodyLimitMiddleware, config=config, on_reject=on_reject)
    app.add_middleware(AccessMiddleware, config=config, on_reject=on_reject)
    app.add_api_route("/v1/images/generations", _images_route(state, "generations", False), methods=["POST"])
    app.add_api_route("/v1/images/edits", _images_route(state, "edits", True), methods=["POST"])

    @app.get("/v1/models")
    def models() -> ModelList:
        created = state.loaded_at or int(time.time())
        name = config.served_model_name
        return ModelList(data=[ModelCard(id=name, created=created, root=name)])

    @app.get("/health")
    def health() -> JSONResponse:
        status, body = state.health()
        return JSONResponse(body, status_code=status)

    # HEAD, as load balancers check: GET's status and headers without the body (the server leaves it out)
    app.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)

    @app.get("/metrics")
    def metrics() -> PlainTextResponse:
        return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4")

    return app
