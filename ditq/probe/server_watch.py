"""Whether an endpoint's server is still there, after a request lost its connection.

A server that went away (killed, restarted, out of host memory) refuses every connection at once, so without
a wait the rest of a run would be recorded as failures within milliseconds. Instead the first request to lose
its connection polls ``/health`` with backoff (0.5 s, doubling to 8 s) until the server answers again or
``limit_s`` has passed; the endpoint's other workers wait for that answer rather than poll too. When the server
answers, the request is sent again; when the limit passes, the server counts as gone and later lost connections
are recorded at once, each saying so, until a request is answered again.
"""

from __future__ import annotations

import threading
import time
from datetime import datetime, timezone

import httpx

__all__ = ["LOST_CONNECTION", "ServerWatch"]

# The server did not answer at all: the connection was refused, reset or closed before a response.
LOST_CONNECTION = (httpx.NetworkError, httpx.RemoteProtocolError)

_FIRST_DELAY_S = 0.5
_LONGEST_DELAY_S = 8.0


class ServerWatch:
    """One endpoint's server, shared by every worker that sends to it."""

    def __init__(self, endpoint: str, limit_s: float) -> None:
        self.endpoint, self.limit_s = endpoint, limit_s
        self._lock = threading.Lock()
        self._gone_since: str | None = None  # UTC time the server was last found gone

    def answered(self) -> None:
        """A request was answered: the server is there."""
        self._gone_since = None

    def _answers(self) -> bool:
        """/health answers with anything but a server error (a server without /health says 404)."""
        try:
            return httpx.get(f"{self.endpoint}/health", timeout=5.0).status_code < 500
        except httpx.HTTPError:
            return False

    def wait_for_return(self) -> str | None:
        """None once the server answers /health again; else why the request is recorded as failed."""
        with self._lock:
            if self._gone_since is not None:
                return f"the server has not answered /health since {self._gone_since}"
            started = datetime.now(timezone.utc).isoformat(timespec="seconds")
            deadline = time.monotonic() + self.limit_s
            delay_s = _FIRST_DELAY_S
            while not self._answers():
                remaining_s = deadline - time.monotonic()
                if remaining_s <= 0:
                    self._gone_since = started
                    return f"the server did not answer /health for {self.limit_s:g} s (polled with backoff)"
                time.sleep(min(delay_s, remaining_s))
                delay_s = min(delay_s * 2, _LONGEST_DELAY_S)
            return None
