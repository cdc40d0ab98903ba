"""An ASGI middleware that streams a request body to the app under a size limit and a deadline.

Nothing is buffered here: each chunk is counted as the app reads it. A declared Content-Length over the limit
is answered 413 before a byte is read; a body that grows past it stops the app's read with 413, and a body
that has not fully arrived ``body_timeout_s`` after its headers stops it with 408. Both close the connection.
An answer the app gives before reading the body (a 404, a 503 while loading) waits until the rest of the body is
read, within the same limit and deadline: a connection closed on unread bytes is reset, and the reset can reach
the client before the answer. Where the rest does not come, the answer closes the connection (a 404 to a slow body
would otherwise keep receiving it). JSON bodies get ``max_json_body_bytes`` (prompts are small), every other body
``max_body_bytes``. After a body of more than ``TRIM_AFTER_BYTES`` the heap's free pages go back to the OS.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ditq.runtime.memory import return_free_host_memory
from ditq.serve.config import ServeConfig
from ditq.serve.errors import APIError, body_timeout, body_too_large

__all__ = ["TRIM_AFTER_BYTES", "BodyLimitMiddleware", "send_error"]

TRIM_AFTER_BYTES = 8 * 1024**2


async def send_error(send: Send, error: APIError) -> None:
    """An APIError as a whole HTTP response, for middleware that answers before the app."""
    body = error.json_bytes()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(name.encode(), value.encode()) for name, value in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class BodyLimitMiddleware:
    """``on_reject(path, status, seconds)`` is told of each request this middleware answers itself."""

    def __init__(
        self, app: ASGIApp, config: ServeConfig, on_reject: Callable[[str, int, float], None]
    ) -> None:
        self.app, self.config, self.on_reject = app, config, on_reject

    def _limit(self, headers: Headers) -> tuple[int, str]:
        media_type = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media_type == "application/json":
            return self.config.max_json_body_bytes, "JSON"
        return self.config.max_body_bytes, "this content type"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = Headers(scope=scope) if scope["type"] == "http" else None
        declared = headers.get("content-length", "") if headers is not None else ""
        if headers is None or (declared in ("", "0") and "transfer-encoding" not in headers):
            await self.app(scope, receive, send)  # no body to guard
            return
        started = time.perf_counter()
        limit, kind = self._limit(headers)
        if declared.isdigit() and int(declared) > limit:
            await self._answer(scope, send, body_too_large(limit, kind), started)
            return
        timeout_s = self.config.body_timeout_s
        deadline = started + timeout_s
        received, complete, responded = 0, False, False

        async def guarded_receive() -> Message:
            nonlocal received, complete
            if complete:  # only http.disconnect is left to wait for: no deadline on that
                return await receive()
            with anyio.move_on_after(deadline - time.perf_counter()) as timer:
                message = await receive()
            if timer.cancelled_caught:
                raise body_timeout(timeout_s)
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise body_too_large(limit, kind)
                complete = not message.get("more_body", False)
            return message

        async def drain() -> None:
            """Read what is left of the body, within the limit and the deadline, before an answer the app gave
            without it (a 503 while loading, say): a connection closed on unread bytes is reset, and the reset can
            reach the client before the answer does, which it then never reads."""
            try:
                while not complete and (await guarded_receive())["type"] != "http.disconnect":
                    pass
            except APIError:  # over the limit or past the deadline: the answer goes out, the rest unread
                pass

        async def watched_send(message: Message) -> None:
            nonlocal responded
            if message["type"] == "http.response.start" and not complete:
                await drain()
                # the rest did not come in time or in bounds: the connection cannot be reused
                if not complete:
                    headers = list(message.get("headers", []))
                    if not any(name.lower() == b"connection" for name, _ in headers):
                        message = {**message, "headers": [*headers, (b"connection", b"close")]}
            responded = True
            await send(message)

        try:
            await self.app(scope, guarded_receive, watched_send)
        except APIError as error:  # raised by guarded_receive in a read the app did not answer itself
            if responded:
                raise
            await self._answer(scope, send, error, started)
        if received > TRIM_AFTER_BYTES:
            await anyio.to_thread.run_sync(return_free_host_memory)

    async def _answer(self, scope: Scope, send: Send, error: APIError, started: float) -> None:
        await send_error(send, error)
        self.on_reject(scope["path"], error.status, time.perf_counter() - started)
