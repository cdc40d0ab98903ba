"""Request and response bodies of the images API: OpenAI's fields plus vLLM-Omni's extensions.

Types are checked here (pydantic, unknown fields rejected); ranges that depend on the server's
settings or on the served pipeline are checked in :mod:`ditq.serve.validation`.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from ditq.runtime.stage_metrics import (
    StageMetrics,  # one generation's timings: the answer's and the baseline's
)

__all__ = [
    "ImageData",
    "ImageRequest",
    "ImageResponse",
    "ImageUsage",
    "LoraChoice",
    "ModelCard",
    "ModelList",
    "StageMetrics",
]


class LoraChoice(BaseModel):
    """One adapter a request picks (vLLM-Omni's ``lora`` object): a name loaded with ``--lora``, and a scale (omitted:
    the one it was loaded with)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    scale: float | None = None


def _one_as_a_list(value: object) -> object:
    return [value] if isinstance(value, dict) else value


class ImageRequest(BaseModel):
    """Body of POST /v1/images/generations (JSON) and the form fields of /v1/images/edits.

    What the server does with each field, and which endpoint takes it, is :mod:`ditq.serve.request_fields`'s
    table; here are the types and OpenAI's value sets.
    """

    model_config = ConfigDict(extra="forbid")

    prompt: str
    model: str | None = None
    n: int = 1
    size: str = "auto"  # "WxH" or "auto" (the pipeline's default size)
    response_format: str = "b64_json"  # only b64_json: the server keeps no files to link to
    output_format: Literal["png", "jpeg", "webp"] = "png"
    output_compression: int | None = Field(None, ge=0, le=100)  # jpeg and webp: the encoder's quality
    background: Literal["transparent", "opaque", "auto"] = "auto"
    # accepted and ignored
    quality: Literal["auto", "low", "medium", "high", "xhigh", "max", "standard", "hd"] = "auto"
    complexity: Literal["low", "medium", "high"] | None = None
    style: Literal["vivid", "natural"] | None = None
    input_fidelity: Literal["high", "low"] | None = None
    moderation: Literal["low", "auto"] = "auto"
    user: str | None = None
    safety_identifier: str | None = None
    # refused unless they ask for nothing (stream false, partial_images 0)
    stream: bool = False
    partial_images: int = Field(0, ge=0, le=3)
    frame_count: int | None = None
    frame_duration_ms: int | None = None
    svg: dict[str, object] | None = None
    # vLLM-Omni extensions
    seed: int | None = None  # 0 is a valid seed; None draws one
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    true_cfg_scale: float | None = None
    negative_prompt: str | None = None
    return_stage_metrics: bool = False
    # LoRA adapters (vLLM-Omni's field): one or a list (one is read as a list of one); [] for none; omitted: every
    # adapter loaded with --lora
    lora: Annotated[list[LoraChoice], BeforeValidator(_one_as_a_list)] | None = None


class ImageData(BaseModel):
    b64_json: str
    revised_prompt: str | None = None


class ImageUsage(BaseModel):
    """What the request consumed, in the units an image pipeline has (no tokens are counted)."""

    input_images: int
    output_images: int
    output_pixels: int  # width * height * output_images


class ImageResponse(BaseModel):
    created: int
    data: list[ImageData]
    output_format: str
    size: str
    background: str
    usage: ImageUsage
    metrics: StageMetrics
    warnings: list[str] = Field(default_factory=list)
    ignored_fields: list[str] = Field(default_factory=list)  # given, accepted, and without effect (in order)

    def json_bytes(self) -> bytes:
        """The body as compact UTF-8 JSON (as starlette's JSONResponse writes it, ``data`` first), each image's
        base64 joined in as bytes: json.dumps scans every character of a string for escapes, 20-35 ms for one
        1024x1024 PNG answer's 5.6 MB of base64 on a small CPU, and base64's alphabet holds nothing to escape."""
        rest = _compact_json(self.model_dump(exclude_none=True, exclude={"data"}))
        parts = [b'{"data":[']
        for index, item in enumerate(self.data):
            fields = _compact_json(item.model_dump(exclude_none=True, exclude={"b64_json"}))
            parts += [b"," if index else b"", b'{"b64_json":"', item.b64_json.encode("ascii")]
            parts.append(b'"}' if fields == b"{}" else b'",' + fields[1:])
        parts += [b"],", rest[1:]]
        return b"".join(parts)  # one copy of each image's base64


def _compact_json(content: object) -> bytes:
    return json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "ditq"
    root: str  # the served model name (never a local path)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
