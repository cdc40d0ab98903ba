"""A small, real OpenAI-compatible images server on loopback, for the harness tests.

It answers ``/v1/images/generations`` (JSON) and ``/v1/images/edits`` (multipart,
``image[]``) with a deterministic PNG drawn from the seed, the size and the
prompt, and can be switched to misbehave: HTTP 500 for chosen seeds, a hang past
the client's timeout, requests held until the test releases them, collapsed
(see-through, striped) images, or dimmed images.
"""

from __future__ import annotations

import asyncio
import base64
import io
import socket
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from PIL import Image

__all__ = ["StubServer", "StubState", "collapsed_image", "healthy_image"]


@dataclass
class StubState:
    fail_seeds: set[int] = field(default_factory=set)  # answer HTTP 500 for these seeds
    hang_seeds: set[int] = field(default_factory=set)  # sleep hang_s before answering
    hang_s: float = 5.0
    delay_s: float = 0.0  # every request takes at least this long
    collapse: bool = False  # answer see-through horizontal-stripe noise
    dim: float | None = None  # scale RGB by this factor (a drift, not a collapse)
    alpha: int | None = None  # set every pixel's alpha to this value
    hold: threading.Event | None = None  # when given, every request waits until it is set
    requests: list[dict[str, Any]] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)  # every path asked for, /health and unknown ones included
    health: dict[str, Any] | None = None  # GET /health's body, as ditq serve would say it (None: 404)


def healthy_image(seed: int, width: int, height: int, salt: int = 0) -> Image.Image:
    """Opaque RGBA: smooth colour fields plus mild seeded noise; same inputs, same pixels."""
    rng = np.random.default_rng(seed * 1_000_003 + salt)
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    channels = []
    for _ in range(3):
        fx, fy, phase = rng.uniform(0.5, 3.0), rng.uniform(0.5, 3.0), rng.uniform(0, 2 * np.pi)
        wave = np.sin(2 * np.pi * (fx * x / width + fy * y / height) + phase)
        channels.append(128 + 90 * wave + rng.normal(0, 6, size=(height, width)))
    rgb = np.clip(np.stack(channels, axis=2), 0, 255).astype(np.uint8)
    alpha = np.full((height, width, 1), 255, dtype=np.uint8)
    return Image.fromarray(np.concatenate([rgb, alpha], axis=2), "RGBA")


def collapsed_image(seed: int, width: int, height: int) -> Image.Image:
    """The seed's broken signature: rows of random grey, alpha hovering around half."""
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, 256, size=(height, 1, 1))
    rgb = np.repeat(np.repeat(rows, width, axis=1), 3, axis=2).astype(np.uint8)
    alpha = np.clip(rng.normal(125, 20, size=(height, 1, 1)), 1, 254).repeat(width, axis=1).astype(np.uint8)
    return Image.fromarray(np.concatenate([rgb, alpha], axis=2), "RGBA")


def _png(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def make_app(state: StubState) -> FastAPI:
    app = FastAPI()

    @app.middleware("http")
    async def note_path(request: Request, call_next: Any) -> Any:
        state.paths.append(request.url.path)
        return await call_next(request)

    async def answer(fields: dict[str, Any], n_images: int) -> JSONResponse:
        seed = int(fields["seed"])
        width, height = (int(v) for v in str(fields["size"]).split("x"))
        state.requests.append({**fields, "n_images": n_images})
        while state.hold is not None and not state.hold.is_set():
            await asyncio.sleep(0.02)
        if state.delay_s:
            await asyncio.sleep(state.delay_s)
        if seed in state.hang_seeds:
            await asyncio.sleep(state.hang_s)
        if seed in state.fail_seeds:
            return JSONResponse({"error": {"message": "stub: internal error"}}, status_code=500)
        if state.collapse:
            image = collapsed_image(seed, width, height)
        else:
            image = healthy_image(seed, width, height, zlib.crc32(str(fields["prompt"]).encode()) + n_images)
            if state.dim is not None:
                array = np.asarray(image).copy()
                array[..., :3] = (array[..., :3] * state.dim).astype(np.uint8)
                image = Image.fromarray(array, "RGBA")
            if state.alpha is not None:
                array = np.asarray(image).copy()
                array[..., 3] = state.alpha
                image = Image.fromarray(array, "RGBA")
        return JSONResponse(
            {
                "created": int(time.time()),
                "data": [{"b64_json": _png(image)}],
                "usage": {"images": 1},
                "metrics": {"peak_memory_mb": 1000.0 + n_images},
            }
        )

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.health is None:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        return JSONResponse(state.health)

    @app.post("/v1/images/generations")
    async def generations(request: Request) -> JSONResponse:
        return await answer(await request.json(), 0)

    @app.post("/v1/images/edits")
    async def edits(request: Request) -> JSONResponse:
        form = await request.form()
        images = form.getlist("image[]")
        for upload in images:
            Image.open(io.BytesIO(await upload.read())).verify()  # type: ignore[union-attr]
        fields = {k: v for k, v in form.items() if k != "image[]"}
        return await answer(fields, len(images))

    return app


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class StubServer:
    """``with StubServer() as server: server.url`` -- uvicorn in a thread on a free loopback port."""

    def __init__(self, state: StubState | None = None, port: int | None = None) -> None:
        self.state = state or StubState()
        self.port = port or _free_port()  # a given port: a server that comes back where one stopped
        config = uvicorn.Config(
            make_app(self.state),
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            timeout_graceful_shutdown=1,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> StubServer:
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("stub server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
