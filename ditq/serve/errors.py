"""HTTP errors in OpenAI's envelope: ``{"error": {"message", "type", "param", "code"}}``.

Every failure the server reports goes through :class:`APIError`, so the status code, the error
type and the machine-readable ``code`` are chosen in one place per cause (the constructors below).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse

__all__ = [
    "APIError",
    "bad_field",
    "bad_host",
    "body_timeout",
    "body_too_large",
    "busy",
    "cross_origin",
    "draining",
    "envelope",
    "loading",
    "model_not_found",
    "non_finite_output",
    "out_of_memory",
    "over_budget",
    "over_memory_budget",
    "queue_full",
    "request_timeout",
    "server_fault",
    "unauthorized",
    "unsupported_media_type",
]


@dataclass
class APIError(Exception):
    """An HTTP error the client sees: status plus OpenAI's four error fields."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    # HTTP headers beside the body: Retry-After, WWW-Authenticate, or Connection: close where the rest of the
    # request body is not read (the connection cannot carry another request).
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict[str, Any]:
        return envelope(self.message, self.type, self.param, self.code)

    def json_bytes(self) -> bytes:
        return json.dumps(self.body()).encode()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def envelope(message: str, type: str, param: str | None, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_field(param: str, message: str, code: str = "invalid_value") -> APIError:
    """400: one field of the request is invalid; the message names it."""
    return APIError(400, f"{param}: {message}", param=param, code=code)


def model_not_found(name: str, served: str) -> APIError:
    return APIError(
        404,
        f"model: '{name}' is not served here; this server serves '{served}'",
        param="model",
        code="model_not_found",
    )


_CLOSE = {"connection": "close"}


def body_too_large(limit_bytes: int, kind: str) -> APIError:
    return APIError(
        413,
        f"request body is larger than the limit of {limit_bytes} bytes for {kind}",
        code="body_too_large",
        headers=_CLOSE,
    )


def body_timeout(seconds: float) -> APIError:
    return APIError(
        408, f"the request body did not arrive within {seconds:g} s", code="body_timeout", headers=_CLOSE
    )


def unsupported_media_type(expected: str, got: str) -> APIError:
    return APIError(
        415,
        f"body: this endpoint takes {expected}, got content-type '{got[:80]}'",
        param="body",
        code="unsupported_media_type",
        headers=_CLOSE,
    )


def unauthorized() -> APIError:
    return APIError(
        401,
        "missing or wrong API key; send 'Authorization: Bearer <key>'",
        code="invalid_api_key",
        headers={**_CLOSE, "www-authenticate": "Bearer"},
    )


def bad_host() -> APIError:
    return APIError(
        400, "the Host header names a host this server does not serve", code="invalid_host", headers=_CLOSE
    )


def cross_origin() -> APIError:
    return APIError(
        403,
        "cross-origin requests are refused (the Origin header names another host)",
        code="cross_origin",
        headers=_CLOSE,
    )


def over_budget(message: str) -> APIError:
    """413: the request can never run within this server's time budget, whatever else it waits for."""
    return APIError(413, message, code="over_budget")


def over_memory_budget(message: str) -> APIError:
    """413: the request can never fit this server's accelerator (or host) memory; like a request that ran out
    of memory (503 ``out_of_memory``), it may fit a server with more offload or a larger budget."""
    return APIError(413, message, code="over_memory_budget")


def busy(message: str, retry_after_s: float) -> APIError:
    """429: the work queued ahead leaves no time for this request before its deadline."""
    return APIError(
        429,
        message,
        type="rate_limit_error",
        code="busy",
        headers={"retry-after": str(max(1, math.ceil(retry_after_s)))},
    )


def queue_full(max_queue: int) -> APIError:
    return APIError(
        429,
        f"the generation queue is full ({max_queue} waiting); retry later",
        type="rate_limit_error",
        code="queue_full",
    )


def loading() -> APIError:
    return APIError(503, "the model is still loading; retry later", type="server_error", code="model_loading")


def draining(detail: str = "takes no new requests") -> APIError:
    return APIError(
        503, f"the server is shutting down and {detail}", type="server_error", code="draining", headers=_CLOSE
    )


def degraded(detail: str) -> APIError:
    """A parallel server whose ranks are no longer in step (``ditq.serve.ranks``): nothing is served until it
    restarts."""
    return APIError(
        503,
        f"the server lost one of its parallel ranks ({detail}) and serves nothing until it restarts",
        type="server_error",
        code="degraded",
    )


def out_of_memory(detail: str) -> APIError:
    return APIError(
        503,
        f"the accelerator ran out of memory for this request ({detail}); memory was freed, retry smaller",
        type="server_error",
        code="out_of_memory",
    )


def request_timeout(seconds: float) -> APIError:
    return APIError(
        504,
        f"the request did not finish within the timeout of {seconds:g} s",
        type="server_error",
        code="timeout",
    )


def server_fault(code: str, error_id: str) -> APIError:
    """500 ``generation_failed`` or ``internal_error`` without the exception's text (it may name files and
    commands); the log has it under ``error_id``."""
    return APIError(
        500,
        f"{code.replace('_', ' ')}; the server log has the details under error id {error_id}",
        type="server_error",
        code=code,
    )


def non_finite_output(detail: str) -> APIError:
    return APIError(
        500,
        f"the generated image is collapsed and was not returned: {detail}",
        type="server_error",
        code="non_finite_output",
    )
