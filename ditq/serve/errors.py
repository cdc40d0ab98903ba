"""HTTP errors in OpenAI's envelope: ``{"error": {"message", "type", "param", "code"}}``.

Every failure the server reports goes through :class:`APIError`, so the status code, the error
type and the machine-readable ``code`` are chosen in one place per cause (the constructors below).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__all__ = [
    "APIError",
    "bad_field",
    "body_too_large",
    "draining",
    "envelope",
    "generation_failed",
    "loading",
    "model_not_found",
    "non_finite_output",
    "out_of_memory",
    "queue_full",
    "request_timeout",
]


@dataclass
class APIError(Exception):
    """An HTTP error the client sees: status plus OpenAI's four error fields."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict[str, Any]:
        return envelope(self.message, self.type, self.param, self.code)

    def json_bytes(self) -> bytes:
        return json.dumps(self.body()).encode()


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


def body_too_large(limit_bytes: int) -> APIError:
    return APIError(
        413, f"request body is larger than the limit of {limit_bytes} bytes", code="body_too_large"
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


def draining() -> APIError:
    return APIError(
        503, "the server is shutting down and takes no new requests", type="server_error", code="draining"
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


def generation_failed(detail: str) -> APIError:
    return APIError(500, f"generation failed: {detail}", type="server_error", code="generation_failed")


def non_finite_output(detail: str) -> APIError:
    return APIError(
        500,
        f"the generated image is collapsed and was not returned: {detail}",
        type="server_error",
        code="non_finite_output",
    )
