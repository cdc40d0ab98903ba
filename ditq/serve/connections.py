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
- Half-close: a client that shuts its sending side after a whole request (``shutdown(SHUT_WR)``) still gets its
  answer. A client that closed altogether sends the same end of stream, so the server tells them apart by
  writing an interim ``100 Continue`` (which HTTP/1.1 clients must accept before any answer): a closed socket
  answers it with a reset, and that client is treated as gone (its request dropped or stopped), as before.
- Log: these events, and uvicorn's own warnings, are summarized at most once per ``LOG_EVERY_S`` per kind, and
  access-log paths are cut at 200 characters.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from dataclasses import dataclass
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ditq.serve.errors import envelope

__all__ = [
    "LOG_EVERY_S",
    "PEER_CHECK_S",
    "ConnectionLimits",
    "guarded_protocol",
    "quiet_floods",
    "uvicorn_config",
]

logger = logging.getLogger(__name__)

LOG_EVERY_S = 10.0
PEER_CHECK_S = 0.1  # while half-closed: how often to look for the reset that says the client is gone
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
        _peer_timer: asyncio.TimerHandle | None = None
        _half_closed = False

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
            if self._peer_timer is not None:
                self._peer_timer.cancel()
            super().connection_lost(exc)

        def eof_received(self) -> bool | None:  # type: ignore[override]  # asyncio: True keeps it open
            """Keep the connection open for the answer (True) when the end of stream follows a whole request whose
            answer has not started; otherwise close it (uvicorn's way)."""
            cycle = self.cycle
            if (
                self.conn.their_state is not h11.DONE
                or self.conn.our_state is not h11.SEND_RESPONSE
                or cycle is None
                or cycle.response_started
            ):
                return None
            self._half_closed = True
            self.transport.write(
                self.conn.send(h11.InformationalResponse(status_code=100, headers=[], reason="Continue"))
            )
            self._peer_timer = self.loop.call_later(PEER_CHECK_S, self._check_peer)
            return True

        def _check_peer(self) -> None:
            """A reset of the interim answer sets the socket's error: the client closed, not half-closed."""
            self._peer_timer = None
            if self.transport.is_closing() or self.cycle is None or self.cycle.response_complete:
                return
            sock = self.transport.get_extra_info("socket")
            if sock is not None and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                self.transport.abort()  # connection_lost: the request is seen as disconnected
                return
            self._peer_timer = self.loop.call_later(PEER_CHECK_S, self._check_peer)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # the request line and headers are in
                self._disarm_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._half_closed:  # answered; no further request can come
                self.transport.close()
            elif not self.transport.is_closing() and not self._inside_request():
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
