"""Connections before they are requests: a cap, a header deadline, an idle deadline, and a log that a flood
cannot fill. uvicorn's h11 protocol, subclassed per server (:func:`uvicorn_config`).

- Cap: past ``max_connections`` open connections, a new one evicts the oldest connection that is not inside
  a request (idle keep-alive, or still sending its headers); when every connection is inside a request, the
  new one is answered 503 ``too_many_connections`` and closed. Held sockets never reach the process's file
  limit, so accept() keeps working and a real client gets in.
- Header deadline: a connection whose request line and headers have not all arrived ``header_timeout_s``
  after it opened (or after its previous response) is closed: a slow-header client holds nothing for long.
- Idle deadline: uvicorn's keep-alive timeout (``idle_timeout_s``) closes a connection idle between requests.
  The body has its own deadline (body_limit.py).
- Log: these events, and uvicorn's own warnings, are summarized at most once per ``LOG_EVERY_S`` per kind, and
  access-log paths are cut at 200 characters.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ditq.serve.errors import envelope

__all__ = ["LOG_EVERY_S", "ConnectionLimits", "guarded_protocol", "quiet_floods", "uvicorn_config"]

logger = logging.getLogger(__name__)

LOG_EVERY_S = 10.0
GRACEFUL_CLOSE_S = 5  # after the drain: how long uvicorn waits for connections to finish their responses


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int = 256
    header_timeout_s: float = 10.0
    idle_timeout_s: int = 5

    def __post_init__(self) -> None:
        if self.max_connections < 1 or self.header_timeout_s <= 0 or self.idle_timeout_s <= 0:
            raise ValueError(f"connection limits must be positive: {self}")


class _Tally:
    """Counts events by kind and logs what it counted at most every LOG_EVERY_S (the rest of a burst once the
    period is over)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.last_logged = -LOG_EVERY_S
        self.flush_pending = False

    def note(self, kind: str, loop: asyncio.AbstractEventLoop) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        wait = self.last_logged + LOG_EVERY_S - time.monotonic()
        if wait <= 0:
            self.flush()
        elif not self.flush_pending:
            self.flush_pending = True
            loop.call_later(wait, self.flush)

    def flush(self) -> None:
        self.flush_pending = False
        if self.counts:
            summary = ", ".join(f"{count} {name}" for name, count in sorted(self.counts.items()))
            logger.warning("connections: %s", summary)
            self.counts.clear()
            self.last_logged = time.monotonic()


def _raw_error(status: int, reason: str, message: str, code: str) -> bytes:
    body = json.dumps(envelope(message, "server_error", None, code)).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode() + body


def guarded_protocol(limits: ConnectionLimits) -> type[H11Protocol]:
    """An H11Protocol class that enforces ``limits`` across the connections of one server."""
    tally = _Tally()
    opened: dict[GuardedProtocol, None] = {}  # insertion order: the oldest first
    too_many = _raw_error(
        503,
        "Service Unavailable",
        f"the server holds {limits.max_connections} connections",
        "too_many_connections",
    )

    class GuardedProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def _inside_request(self) -> bool:
            return self.conn.their_state is not h11.IDLE or (
                self.cycle is not None and not self.cycle.response_complete
            )

        def _arm_header_timer(self) -> None:
            self._disarm_header_timer()
            self._header_timer = self.loop.call_later(limits.header_timeout_s, self._headers_too_slow)

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if not self._inside_request() and not self.transport.is_closing():
                tally.note("closed without complete headers in time", self.loop)
                self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            opened[self] = None
            if len(opened) > limits.max_connections:
                idle = next((c for c in opened if c is not self and not c._inside_request()), None)
                if idle is None:
                    tally.note("refused at the cap", self.loop)
                    transport.write(too_many)
                    transport.close()
                    return
                tally.note("idle evicted at the cap", self.loop)
                opened.pop(idle, None)
                idle._disarm_header_timer()
                idle.transport.close()
            self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            opened.pop(self, None)
            self._disarm_header_timer()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # the request line and headers are in
                self._disarm_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and not self._inside_request():
                self._arm_header_timer()

    return GuardedProtocol


class _Collapse(logging.Filter):
    """The same message at most once per LOG_EVERY_S (then how many were left out); access paths cut short."""

    def __init__(self) -> None:
        super().__init__()
        self.last: dict[str, float] = {}
        self.left_out: dict[str, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "uvicorn.access":
            if isinstance(record.args, tuple) and len(record.args) >= 3 and isinstance(record.args[2], str):
                path = record.args[2]
                record.args = (*record.args[:2], path[:200], *record.args[3:])
            return True
        if record.levelno < logging.WARNING:
            return True
        key, now = str(record.msg), time.monotonic()
        if now - self.last.get(key, -LOG_EVERY_S) < LOG_EVERY_S:
            self.left_out[key] = self.left_out.get(key, 0) + 1
            return False
        self.last[key] = now
        if (count := self.left_out.pop(key, 0)) > 0:
            record.msg = f"{record.msg} (and {count} more like it in the last {LOG_EVERY_S:g} s)"
        return True


def quiet_floods() -> None:
    """Attach the collapsing filter to uvicorn's loggers (once)."""
    collapse = _Collapse()
    for name in ("uvicorn.error", "uvicorn.access", "asyncio"):
        target = logging.getLogger(name)
        if not any(isinstance(f, _Collapse) for f in target.filters):
            target.addFilter(collapse)


def uvicorn_config(
    app: Any, limits: ConnectionLimits, host: str = "127.0.0.1", port: int = 8091, **kwargs: Any
) -> uvicorn.Config:
    """uvicorn's config with the guarded protocol, the idle deadline and a bounded graceful close."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        http=guarded_protocol(limits),
        timeout_keep_alive=limits.idle_timeout_s,
        timeout_graceful_shutdown=GRACEFUL_CLOSE_S,
        **kwargs,
    )
    quiet_floods()  # after uvicorn configured its loggers
    return config
