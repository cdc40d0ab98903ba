"""The server's settings, validated once at the edge."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from PIL import Image

from ditq.errors import InputError

__all__ = ["CollapsePolicy", "ServeConfig", "api_key_problem"]

# "error": a collapsed image fails its request with 500 non_finite_output; "warn": it is returned
# with a "warnings" entry in the response. Either way it is logged and counted.
CollapsePolicy = Literal["error", "warn"]


def api_key_problem(key: str) -> str | None:
    """Why ``key`` could never match an ``Authorization: Bearer`` header, or None: a header carries printable
    ASCII only, and the server strips the spaces around the token. The key itself is never shown."""
    if not key.strip():
        return "must not be empty"
    if key != key.strip():
        return "has white space at its start or end, which no Authorization header can carry"
    bad = next((i for i, c in enumerate(key) if not " " <= c <= "~"), None)
    if bad is not None:
        return f"has a character that is not printable ASCII (character {bad + 1}), which no Authorization header can carry"
    return None


@dataclass(frozen=True)
class ServeConfig:
    """What the HTTP layer enforces. Limits are per request unless named otherwise."""

    served_model_name: str = "ditq-demo"
    max_queue: int = 16  # requests waiting behind the one being generated; more -> 429
    request_timeout_s: float = 600.0  # from arrival to response, queue wait included; -> 504
    max_body_bytes: int = 64 * 1024**2  # a multipart body (edits); -> 413
    max_json_body_bytes: int = 1024**2  # a JSON body (generations: prompts of 32000 characters fit); -> 413
    body_timeout_s: float = 60.0  # from the request's headers to the end of its body; -> 408
    max_pixels: int = 2048 * 2048  # width * height of one output image
    # reference images one request may carry; None: as many as the pipeline takes. Calibration measures no more.
    max_references: int | None = None
    max_image_pixels: int = 4096 * 4096  # one uploaded image, read from its header before decoding
    max_upload_pixels: int = 2 * 4096 * 4096  # all uploaded images of one request together
    max_n: int = 4  # images per request
    max_steps: int = 200
    max_scale: float = 50.0  # guidance_scale and true_cfg_scale lie in [0, max_scale]
    max_prompt_chars: int = 32000  # prompt and negative_prompt each
    max_user_chars: int = 256
    on_collapse: CollapsePolicy = "error"
    api_key: str | None = None  # when set, /v1/* and /metrics need "Authorization: Bearer <key>"
    allowed_hosts: tuple[str, ...] | None = None  # Host header names served (None: any); see access.py
    docs: bool = False  # FastAPI's /docs, /redoc and /openapi.json

    def __post_init__(self) -> None:
        positive = {
            "max_queue": self.max_queue,
            "request_timeout_s": self.request_timeout_s,
            "max_body_bytes": self.max_body_bytes,
            "max_json_body_bytes": self.max_json_body_bytes,
            "body_timeout_s": self.body_timeout_s,
            "max_pixels": self.max_pixels,
            "max_image_pixels": self.max_image_pixels,
            "max_upload_pixels": self.max_upload_pixels,
            "max_n": self.max_n,
            "max_steps": self.max_steps,
            "max_scale": self.max_scale,
            "max_prompt_chars": self.max_prompt_chars,
            "max_user_chars": self.max_user_chars,
        }
        for name, value in positive.items():
            if value <= 0:
                raise InputError(f"serve setting {name} must be positive, got {value}")
        if self.max_references is not None and self.max_references < 0:
            raise InputError(f"serve setting max_references must be 0 or more, got {self.max_references}")
        # Pillow warns above MAX_IMAGE_PIXELS and refuses above twice that; the server's caps lie below, so
        # the server decides (from the header, before decoding) and Pillow's check is a second line.
        bomb = Image.MAX_IMAGE_PIXELS
        for name in ("max_image_pixels", "max_upload_pixels"):
            if bomb is not None and getattr(self, name) >= bomb:
                raise InputError(
                    f"serve setting {name} must stay below Pillow's bomb limit of {bomb} pixels, "
                    f"got {getattr(self, name)}"
                )
        if self.on_collapse not in ("error", "warn"):
            raise InputError(f"serve setting on_collapse must be 'error' or 'warn', got {self.on_collapse!r}")
        if self.api_key is not None and (problem := api_key_problem(self.api_key)) is not None:
            raise InputError(f"serve setting api_key: {problem}")
