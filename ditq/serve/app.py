"""The FastAPI application: the images API, /v1/models, /health and /metrics.

Request path: parse (400) -> validate against settings and pipeline (400) -> enqueue (429) ->
wait for the worker, watching the deadline (504) and the client (dropped when gone) ->
check the images for collapse (500 non_finite_output) -> encode -> respond with stage metrics.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException

from ditq.errors import InputError
from ditq.runtime.adapter import GenerationRequest, GenerationResult, PipelineAdapter
from ditq.serve import errors
from ditq.serve.body_limit import BodyLimitMiddleware
from ditq.serve.config import ServeConfig
from ditq.serve.errors import APIError, envelope
from ditq.serve.images import collapse_reasons, encode_image
from ditq.serve.parsing import parse_form, parse_json
from ditq.serve.schemas import (
    ImageData,
    ImageRequest,
    ImageResponse,
    ImageUsage,
    ModelCard,
    ModelList,
    StageMetrics,
)
from ditq.serve.state import DoctorOutcome, ServerState
from ditq.serve.validation import decode_images, to_generation_request
from ditq.serve.worker import Job, OutOfMemory, QueueClosed, QueueFull

__all__ = ["create_app"]

logger = logging.getLogger(__name__)

_DISCONNECT_POLL_S = 0.25
_CLIENT_GONE = 499  # recorded in /metrics for a client that left before its answer (nothing is sent)


def _input_error(error: InputError) -> APIError:
    """An adapter refusal ('field: why') as a 400 that names the field."""
    message = str(error)
    prefix = message.split(":", 1)[0]
    return APIError(400, message, param=prefix if prefix.isidentifier() else None, code="invalid_value")


async def _wait(request: Request, state: ServerState, job: Job, deadline: float) -> GenerationResult | None:
    """The job's result; None when the client left (the job is withdrawn if still queued)."""
    assert state.worker is not None
    future = asyncio.wrap_future(job.future)
    while not future.done():
        remaining = deadline - time.perf_counter()
        if remaining <= 0:
            state.worker.cancel(job)
            raise errors.request_timeout(state.config.request_timeout_s)
        await asyncio.wait({future}, timeout=min(remaining, _DISCONNECT_POLL_S))
        if not future.done() and await request.is_disconnected():
            dropped = state.worker.cancel(job)
            logger.info(
                "client disconnected; request %s", "dropped from the queue" if dropped else "discarded"
            )
            return None
    try:
        return future.result()
    except OutOfMemory as error:
        raise errors.out_of_memory(str(error)) from None
    except InputError as error:
        raise _input_error(error) from None
    except Exception as error:
        logger.exception("generation failed")
        raise errors.generation_failed(f"{type(error).__name__}: {error}") from None


def _finish(
    body: ImageRequest, generation: GenerationRequest, job: Job, result: GenerationResult, state: ServerState
) -> ImageResponse:
    """Collapse check, encoding and the response body; runs in a worker thread (CPU-bound)."""
    started = time.perf_counter()
    warnings: list[str] = []
    for index, image in enumerate(result.images):
        reasons = collapse_reasons(image, state.gate_rules)
        if reasons:
            state.metrics.count_collapsed()
            detail = f"image {index + 1} of {len(result.images)}: {'; '.join(reasons)}"
            logger.warning("collapsed output (%s) for prompt %r", detail, generation.prompt[:80])
            if state.config.on_collapse == "error":
                raise errors.non_finite_output(detail)
            warnings.append(f"non_finite_output: {detail}")
    encoded = [encode_image(image, body.output_format, body.background) for image in result.images]
    encode_s = time.perf_counter() - started
    width, height = result.images[0].size
    timings, steps = result.timings, result.step_times
    metrics = StageMetrics(
        queue_wait_ms=job.queue_wait_s * 1000,
        text_encoding_ms=timings.get("text_encoding", 0.0) * 1000,
        denoising_ms=timings.get("denoising", 0.0) * 1000,
        denoise_step_latency_ms=(sum(steps) / len(steps) * 1000) if steps else 0.0,
        decoding_ms=timings.get("decoding", 0.0) * 1000,
        postprocess_time_ms=(timings.get("postprocess", 0.0) + encode_s) * 1000,
        generation_ms=timings.get("total", 0.0) * 1000,
        peak_memory_mb=None if result.peak_memory_bytes is None else result.peak_memory_bytes / 1024**2,
        num_inference_steps=len(steps) or generation.num_inference_steps,
        image_pixels=width * height,
        denoise_step_latencies_ms=[s * 1000 for s in steps] if body.return_stage_metrics else None,
    )
    state.metrics.observe_peak_memory(result.peak_memory_bytes)
    return ImageResponse(
        created=int(time.time()),
        data=[ImageData(b64_json=base64.b64encode(data).decode("ascii")) for data in encoded],
        output_format=body.output_format,
        size=f"{width}x{height}",
        background=body.background,
        usage=ImageUsage(
            input_images=len(generation.images),
            output_images=len(encoded),
            output_pixels=width * height * len(encoded),
        ),
        metrics=metrics,
        warnings=warnings,
    )


async def _generate(request: Request, state: ServerState, edits: bool) -> Response:
    deadline = time.perf_counter() + state.config.request_timeout_s
    worker = state.require_ready()
    adapter = state.adapter
    assert adapter is not None
    if edits:
        body, uploads = await parse_form(request, adapter.max_reference_images)
        images = decode_images(uploads, adapter)
    else:
        body, images = await parse_json(request), []
    generation = to_generation_request(body, images, adapter, state.config)
    try:
        job = worker.submit(generation)
    except QueueFull:
        raise errors.queue_full(state.config.max_queue) from None
    except QueueClosed:
        raise errors.draining() from None
    result = await _wait(request, state, job, deadline)
    if result is None:
        return Response(status_code=_CLIENT_GONE)
    response = await anyio.to_thread.run_sync(_finish, body, generation, job, result, state)
    return JSONResponse(response.model_dump(exclude_none=True))


def _images_route(state: ServerState, endpoint: str, edits: bool) -> Callable[[Request], Any]:
    async def route(request: Request) -> Response:
        started = time.perf_counter()
        try:
            response = await _generate(request, state, edits)
        except APIError as error:
            if error.status >= 500:
                logger.warning("%s -> %d %s: %s", endpoint, error.status, error.code, error.message)
            response = JSONResponse(error.body(), status_code=error.status)
        except Exception as error:  # a fault of the server itself, still answered in the envelope
            logger.exception("%s: internal error", endpoint)
            failure = APIError(
                500, f"internal error: {type(error).__name__}: {error}", "server_error", code="internal_error"
            )
            response = JSONResponse(failure.body(), status_code=500)
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
) -> FastAPI:
    """An app that loads its model in the background at start-up (``load`` then ``doctor``).

    ``facts`` (device, offload, memory budget...) are shown by /health with the load time and kernel paths.
    """
    state = ServerState(config, load, doctor, model_root, on_load_failure, facts)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        state.start()
        yield
        await anyio.to_thread.run_sync(state.stop, drain_timeout_s)

    app = FastAPI(title="ditq serve", lifespan=lifespan)

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, error: HTTPException) -> JSONResponse:
        """Unknown paths and methods, in the same envelope as every other error."""
        return JSONResponse(
            envelope(str(error.detail), "invalid_request_error", None, None), status_code=error.status_code
        )

    app.state.serve = state
    app.add_middleware(
        BodyLimitMiddleware,
        limit=config.max_body_bytes,
        on_reject=lambda path, seconds: state.metrics.observe_request(_endpoint_name(path), 413, seconds),
    )
    app.add_api_route("/v1/images/generations", _images_route(state, "generations", False), methods=["POST"])
    app.add_api_route("/v1/images/edits", _images_route(state, "edits", True), methods=["POST"])

    @app.get("/v1/models")
    def models() -> ModelList:
        created = state.loaded_at or int(time.time())
        return ModelList(data=[ModelCard(id=config.served_model_name, created=created, root=model_root)])

    @app.get("/health")
    def health() -> JSONResponse:
        doctor_outcome = state.doctor_outcome
        body: dict[str, Any] = {"status": state.phase, "model": config.served_model_name, **state.facts}
        if doctor_outcome is not None:
            body["doctor"] = {"status": doctor_outcome.status, "summary": doctor_outcome.summary}
        if state.failure is not None:
            body["error"] = state.failure
        return JSONResponse(body, status_code=200 if state.phase == "ready" else 503)

    @app.get("/metrics")
    def metrics() -> PlainTextResponse:
        return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4")

    return app


def _endpoint_name(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1] or "root"
