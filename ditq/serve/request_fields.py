"""Every request field of the images API and what the server does with it: one table, which the docs' table
(``docs/openai-api.md``) is checked against.

A field is

- ``used``: it shapes the result (its types in :class:`ImageRequest`, its ranges in :mod:`ditq.serve.validation`);
- ``ignored``: accepted, its value checked like any other, then named in the response's ``ignored_fields`` and
  counted in /metrics. It asks OpenAI's models for something that has no counterpart in a diffusion pipeline (an
  effort hint, a moderation level, an end-user id), so a client written for OpenAI runs unchanged;
- ``refused``: it asks for output or input the server does not make (a stream, a mask, an animation): a 400
  naming it (``unsupported_parameter``), unless its value asks for nothing (``accepts``: OpenAI's default, which
  is what is served anyway, such as ``stream: false``).

A field of one endpoint sent to the other is an unknown field, as OpenAI answers it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from ditq.runtime.images import takes_quality
from ditq.serve.errors import APIError, bad_field

if TYPE_CHECKING:
    from ditq.serve.schemas import ImageRequest

__all__ = [
    "ENDPOINTS",
    "PIPELINE_FIELDS",
    "REQUEST_FIELDS",
    "Endpoint",
    "RequestField",
    "Treatment",
    "check_fields",
    "ignored_fields",
    "refusal",
]

Treatment = Literal["used", "ignored", "refused"]
Endpoint = Literal["generations", "edits"]
ENDPOINTS: tuple[Endpoint, ...] = ("generations", "edits")


@dataclass(frozen=True)
class RequestField:
    """One request field: who defined it, where it is taken, and what the server does with it (``how``: for a
    used field how, otherwise why; the docs' table shows it as written)."""

    name: str
    treatment: Treatment
    how: str
    endpoints: tuple[Endpoint, ...] = ENDPOINTS
    origin: Literal["OpenAI", "vLLM-Omni"] = "OpenAI"
    upload: bool = False  # a multipart file (edits), never part of ImageRequest
    pipeline_argument: bool = False  # taken only where the served pipeline has the argument, else a 400
    accepts: tuple[object, ...] = ()  # a refused field's values that ask for nothing new

    def __post_init__(self) -> None:
        if self.accepts and self.treatment != "refused":
            raise ValueError(f"{self.name}: only a refused field lists the values it still accepts")


_EFFORT = "a diffusion pipeline's effort is its step count: ask for num_inference_steps"
_EDITS: tuple[Endpoint, ...] = ("edits",)

REQUEST_FIELDS: dict[str, RequestField] = {
    field.name: field
    for field in (
        RequestField("prompt", "used", "the text drawn from; required, not blank, at most 32000 characters"),
        RequestField(
            "model", "used", "must name the served model (--served-model-name), else 404; omitted: that model"
        ),
        RequestField("n", "used", "images per request, 1 to 4"),
        RequestField(
            "size",
            "used",
            "WxH, multiples of the pipeline's alignment, at most --max-pixels; auto: the pipeline's default size",
        ),
        RequestField(
            "response_format", "used", "b64_json only; url is refused (the server keeps no files to link to)"
        ),
        RequestField(
            "output_format",
            "used",
            "png (the default), jpeg or webp; gif and svg are refused (not made here)",
        ),
        RequestField(
            "output_compression",
            "used",
            "0 to 100: the jpeg or webp encoder's quality (95 when omitted); png is lossless, "
            "so there it is ignored and recorded",
        ),
        RequestField(
            "background",
            "used",
            "auto keeps what the pipeline drew, opaque flattens over white, transparent keeps an alpha channel "
            "(png or webp); nothing is cut out: a pipeline that draws no alpha gives an opaque one",
        ),
        RequestField(
            "quality",
            "ignored",
            f"one of OpenAI's values (auto, low, medium, high, xhigh, max, standard, hd); {_EFFORT}",
        ),
        RequestField("complexity", "ignored", f"low, medium or high: OpenAI's planning effort; {_EFFORT}"),
        RequestField(
            "style",
            "ignored",
            "vivid or natural: a setting of the retired DALL-E 3, which OpenAI's current image models do not "
            "take; describe the style in the prompt",
            endpoints=("generations",),
        ),
        RequestField(
            "input_fidelity",
            "ignored",
            "high or low: the pipeline conditions on its reference images one way, with no fidelity setting",
            endpoints=_EDITS,
        ),
        RequestField(
            "moderation",
            "ignored",
            "low or auto: the server moderates nothing, at either level",
            endpoints=("generations",),
        ),
        RequestField("user", "ignored", "at most 256 characters; the server keeps no per-user records"),
        RequestField(
            "safety_identifier", "ignored", "at most 256 characters; the server keeps no per-user records"
        ),
        RequestField(
            "stream",
            "refused",
            "true is refused: the answer is one JSON response, no server-sent events; false is accepted",
            accepts=(False,),
        ),
        RequestField(
            "partial_images",
            "refused",
            "0 to 3; above 0 is refused: partial images come only in a stream; 0 is accepted",
            accepts=(0,),
        ),
        RequestField("frame_count", "refused", "animated GIF output is not made"),
        RequestField("frame_duration_ms", "refused", "animated GIF output is not made"),
        RequestField("svg", "refused", "SVG output is not made (nor its form fields svg[...])"),
        RequestField(
            "image",
            "used",
            "required: the reference images (also image[]), PNG, JPEG or WebP, up to the pipeline's limit, "
            "--max-image-pixels each and --max-upload-pixels together",
            endpoints=_EDITS,
            upload=True,
        ),
        RequestField("mask", "refused", "inpainting is not supported", endpoints=_EDITS, upload=True),
        RequestField("markup", "refused", "a markup overlay is not supported", endpoints=_EDITS, upload=True),
        RequestField("seed", "used", "0 to 2^63-1 (0 is a seed); omitted: one is drawn", origin="vLLM-Omni"),
        RequestField(
            "num_inference_steps",
            "used",
            "1 to 200, where the served pipeline takes it (else 400), and not a count at which the model's "
            "scheduler computes a NaN sigma (400 naming the field: one step on Qwen-Image, whose scheduler divides "
            "by zero there and draws a NaN image); omitted: the pipeline's default",
            origin="vLLM-Omni",
            pipeline_argument=True,
        ),
        RequestField(
            "guidance_scale",
            "used",
            "0 to 50, where the served pipeline takes it (else 400)",
            origin="vLLM-Omni",
            pipeline_argument=True,
        ),
        RequestField(
            "true_cfg_scale",
            "used",
            "0 to 50, where the served pipeline takes it (else 400)",
            origin="vLLM-Omni",
            pipeline_argument=True,
        ),
        RequestField(
            "negative_prompt",
            "used",
            "at most 32000 characters, where the served pipeline takes it (else 400)",
            origin="vLLM-Omni",
            pipeline_argument=True,
        ),
        RequestField(
            "return_stage_metrics",
            "used",
            "true adds every step's latency and, on CUDA, each stage's peak memory to metrics",
            origin="vLLM-Omni",
        ),
        RequestField(
            "lora",
            "used",
            "LoRA adapters by name: {name, scale} or a list of them (edits: as JSON text), each name one loaded with "
            "--lora (else 400), scale in [-10, 10] (omitted: its --lora scale); [] for none; omitted: every adapter "
            "loaded, at its --lora scale",
            origin="vLLM-Omni",
        ),
    )
}

# vLLM-Omni's fields that go to the pipeline as arguments: each must be one the served pipeline takes
# (PipelineAdapter.supports), or the request fails naming it.
PIPELINE_FIELDS = tuple(name for name, field in REQUEST_FIELDS.items() if field.pipeline_argument)


def refusal(name: str) -> APIError:
    """400 for a refused field, naming it and why."""
    return bad_field(name, REQUEST_FIELDS[name].how, code="unsupported_parameter")


def check_fields(body: ImageRequest, endpoint: Endpoint) -> None:
    """400 for a field of the other endpoint (unknown here) or a refused field sent with a value that asks for
    something; the first in the table's order."""
    given = body.model_fields_set
    for name, field in REQUEST_FIELDS.items():
        if name not in given:
            continue
        if endpoint not in field.endpoints:
            raise bad_field(name, f"unknown field for /v1/images/{endpoint}", code="unknown_parameter")
        if field.treatment == "refused" and getattr(body, name) not in field.accepts:
            raise refusal(name)


def ignored_fields(body: ImageRequest) -> list[str]:
    """The fields given that changed nothing, in the table's order: the response records them."""
    given, lossless = body.model_fields_set, not takes_quality(body.output_format)
    return [
        name
        for name, field in REQUEST_FIELDS.items()
        if name in given and (field.treatment == "ignored" or (name == "output_compression" and lossless))
    ]
