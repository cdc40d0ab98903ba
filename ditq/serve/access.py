"""Who may talk to the server: the Host allow-list, the Origin check and the API key, before any body is read.

- Host: with ``allowed_hosts`` set, a request naming another host is refused (400 ``invalid_host``), so a web
  page cannot reach a loopback server through a domain rebound to 127.0.0.1 (DNS rebinding).
- Origin: a browser names the page's origin on cross-site requests; one that is foreign is refused (403
  ``cross_origin``), so a page cannot make the server generate with a form post. Foreign: a host outside
  ``allowed_hosts``; with no allow-list (``'*'``, or a bind beyond loopback without ``--allowed-host``), a host
  other than the one the request's Host header names. Ports are not compared, as the allow-list does not.
- API key: with ``api_key`` set, every path but /health needs ``Authorization: Bearer <key>`` (401
  ``invalid_api_key``), compared in constant time. /health stays open for load balancers and the sweep.
"""

from __future__ import annotations

import hmac
import ipaddress
import time
from collections.abc import Callable
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from ditq.serve import errors
from ditq.serve.body_limit import send_error
from ditq.serve.config import ServeConfig

__all__ = [
    "LOOPBACK_NAMES",
    "AccessMiddleware",
    "default_allowed_hosts",
    "exposure_warning",
    "hostname",
    "is_loopback",
]

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
_OPEN_PATHS = ("/health",)


def hostname(authority: str) -> str:
    """'Example.COM:8091' -> 'example.com'; '[::1]:8091' -> '::1'."""
    host = urlsplit(f"//{authority.strip()}").hostname or ""
    return host.rstrip(".").lower()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def default_allowed_hosts(bind_host: str, extra: list[str]) -> tuple[str, ...] | None:
    """The loopback names for a loopback bind, plus ``extra`` (--allowed-host); None (any host) for a wider
    bind without --allowed-host, since its clients may use any address or name of the machine. '*': any."""
    if "*" in extra:
        return None
    names = tuple(dict.fromkeys(hostname(name) for name in extra))
    if is_loopback(bind_host):
        return tuple(dict.fromkeys((*LOOPBACK_NAMES, hostname(bind_host), *names)))
    return names or None


class AccessMiddleware:
    """``on_reject(path, status, seconds)`` is told of each refusal."""

    def __init__(
        self, app: ASGIApp, config: ServeConfig, on_reject: Callable[[str, int, float], None]
    ) -> None:
        self.app, self.on_reject = app, on_reject
        self.allowed = None if config.allowed_hosts is None else frozenset(config.allowed_hosts)
        self.api_key = None if config.api_key is None else config.api_key.encode()

    def _refusal(self, scope: Scope) -> errors.APIError | None:
        headers = Headers(scope=scope)
        host = hostname(headers.get("host", ""))
        if self.allowed is not None and host not in self.allowed:
            return errors.bad_host()
        origin = headers.get("origin")
        if origin is not None:
            origin_host = hostname(urlsplit(origin).netloc)  # "" for "null" (a sandboxed page, a file)
            same_site = self.allowed if self.allowed is not None else (host,)
            if not origin_host or origin_host not in same_site:
                return errors.cross_origin()
        if self.api_key is not None and scope["path"] not in _OPEN_PATHS:
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key):
                return errors.unauthorized()
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (refusal := self._refusal(scope)) is not None:
            started = time.perf_counter()
            await send_error(send, refusal)
            self.on_reject(scope["path"], refusal.status, time.perf_counter() - started)
            return
        await self.app(scope, receive, send)


def exposure_warning(
    bind_host: str, api_key: str | None, allowed_hosts: tuple[str, ...] | None
) -> str | None:
    """What to warn about at start-up: a server reachable beyond this machine without a key, or one that
    answers to any Host name."""
    if is_loopback(bind_host):
        return None
    problems = []
    if api_key is None:
        problems.append("without --api-key (or DITQ_API_KEY): anyone who can reach it can generate")
    if allowed_hosts is None:
        problems.append("for any Host name (--allowed-host limits it)")
    if not problems:
        return None
    return f"serving on {bind_host}, beyond loopback, " + " and ".join(problems)
