"""An ASGI middleware that answers 413 for a request body over the limit, before the app reads it."""

from __future__ import annotations

import time
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ditq.serve.errors import body_too_large

__all__ = ["BodyLimitMiddleware"]


class BodyLimitMiddleware:
    """Rejects by Content-Length when declared; otherwise reads the (chunked) body up to the limit,
    then replays it to the app. ``on_reject(path, seconds)`` is told of each rejection."""

    def __init__(self, app: ASGIApp, limit: int, on_reject: Callable[[str, float], None]) -> None:
        self.app, self.limit, self.on_reject = app, limit, on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._reject(scope, send, started)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                await self._reject(scope, send, started)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _reject(self, scope: Scope, send: Send, started: float) -> None:
        error = body_too_large(self.limit)
        body = error.json_bytes()
        await send(
            {
                "type": "http.response.start",
                "status": error.status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"connection", b"close"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
        self.on_reject(scope["path"], time.perf_counter() - started)
