"""Checks that depend on the server's settings and on the served pipeline.

Everything here turns a typed :class:`ImageRequest` into the runtime's :class:`GenerationRequest` (its
reference images are added by the worker, see :mod:`ditq.serve.intake`), or raises a 400
:class:`APIError` that names the offending field.
"""

from __future__ import annotations

import math

from ditq.errors import InputError
from ditq.runtime.adapter import GenerationRequest, PipelineAdapter, parse_size
from ditq.serve.config import ServeConfig
from ditq.serve.errors import APIError, bad_field, model_not_found
from ditq.serve.request_fields import PIPELINE_FIELDS
from ditq.serve.schemas import ImageRequest

__all__ = ["check_size", "to_generation_request"]

_SEED_LIMIT = 2**63  # torch.Generator.manual_seed takes a signed 64-bit value


def check_size(size: str, adapter: PipelineAdapter, config: ServeConfig) -> tuple[int, int] | None:
    """'WxH' -> (width, height) that the pipeline and the settings allow; 'auto' -> None (the pipeline chooses)."""
    if size == "auto":
        return None
    try:
        width, height = parse_size(size, "size")
    except InputError as error:
        raise bad_field("size", f"expected WxH (e.g. 512x512) or 'auto', got '{size[:40]}'") from error
    align = adapter.size_alignment
    if width <= 0 or height <= 0 or width % align or height % align:
        raise bad_field("size", f"{width}x{height}: width and height must be positive multiples of {align}")
    if width * height > config.max_pixels:
        raise bad_field(
            "size", f"{width}x{height} is {width * height} pixels, above the limit of {config.max_pixels}"
        )
    return width, height


def _check_range(name: str, value: float | None, low: float, high: float) -> None:
    """Integers are compared as integers (one of 4000 digits has no float)."""
    if value is None:
        return
    if (isinstance(value, float) and not math.isfinite(value)) or not low <= value <= high:
        shown = str(value) if len(str(value)) <= 40 else f"{str(value)[:20]}... ({len(str(value))} digits)"
        raise bad_field(name, f"{shown} is out of range [{low:g}, {high:g}]")


def _check_length(name: str, value: str | None, limit: int) -> None:
    if value is not None and len(value) > limit:
        raise bad_field(name, f"{len(value)} characters, above the limit of {limit}")


def _lora_choice(body: ImageRequest, adapter: PipelineAdapter) -> tuple[tuple[str, float | None], ...] | None:
    """The adapters the request picks, each a name the server loaded with --lora (``LoraAdapters.resolve``); None
    where it picks none explicitly (every adapter at its scale)."""
    if body.lora is None:
        return None
    choice = tuple((item.name, item.scale) for item in body.lora)
    if choice and adapter.lora is None:
        raise bad_field("lora", "the server has no LoRA adapters loaded (ditq serve --lora NAME=PATH)")
    if adapter.lora is not None:
        try:
            adapter.lora.resolve(choice)
        except InputError as error:
            raise bad_field("lora", str(error).removeprefix("lora: ")) from None
    return choice


def to_generation_request(
    body: ImageRequest, adapter: PipelineAdapter, config: ServeConfig
) -> GenerationRequest:
    """Validate ``body`` against the settings and the pipeline; the request the worker will run."""
    if body.model is not None and body.model != config.served_model_name:
        raise model_not_found(body.model[:200], config.served_model_name)
    if not body.prompt.strip():
        raise bad_field("prompt", "must not be empty")
    _check_length("prompt", body.prompt, config.max_prompt_chars)
    _check_length("negative_prompt", body.negative_prompt, config.max_prompt_chars)
    _check_length("user", body.user, config.max_user_chars)
    _check_length("safety_identifier", body.safety_identifier, config.max_user_chars)
    if body.response_format != "b64_json":
        raise bad_field(
            "response_format",
            f"'{body.response_format[:40]}' is not served; only 'b64_json' (no files are kept)",
        )
    if body.background == "transparent" and body.output_format == "jpeg":
        raise bad_field("background", "'transparent' needs output_format png or webp (jpeg has no alpha)")
    _check_range("n", body.n, 1, config.max_n)
    _check_range("num_inference_steps", body.num_inference_steps, 1, config.max_steps)
    steps = body.num_inference_steps
    if steps is not None and (why := adapter.steps_refusal(steps)):
        raise bad_field("num_inference_steps", f"{steps}: {why}")
    _check_range("guidance_scale", body.guidance_scale, 0.0, config.max_scale)
    _check_range("true_cfg_scale", body.true_cfg_scale, 0.0, config.max_scale)
    _check_range("seed", body.seed, 0, _SEED_LIMIT - 1)
    for name in PIPELINE_FIELDS:
        if getattr(body, name) is not None and not adapter.supports(name):
            raise APIError(
                400,
                f"{name}: the served pipeline ({adapter.pipeline_name}) does not take this extension",
                param=name,
                code="unsupported_parameter",
            )
    size = check_size(body.size, adapter, config)
    width, height = size if size is not None else (None, None)
    lora = _lora_choice(body, adapter)
    return GenerationRequest(
        prompt=body.prompt,
        negative_prompt=body.negative_prompt,
        width=width,
        height=height,
        num_inference_steps=body.num_inference_steps,
        guidance_scale=body.guidance_scale,
        true_cfg_scale=body.true_cfg_scale,
        seed=body.seed,
        num_images=body.n,
        lora=lora,
    )
