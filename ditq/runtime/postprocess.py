"""Decoded images leave the device as 8-bit pixels: diffusers' ``output_type="pil"`` arithmetic, run where the
decode ran.

diffusers' ``VaeImageProcessor.postprocess(image, "pil")`` denormalizes on the device, then copies the image to the
host as float32 (12 MiB for 1024x1024 RGB) and scales, rounds and casts it there in numpy, on the thread that runs
the pipeline, before the next request may start. ``pixels_on_device`` replaces that call for the length of a
pipeline call: the same denormalization, then the same float32 arithmetic (``x * 255``, round half to even, cast to
uint8) on the device, and one copy of a quarter of the bytes. IEEE float32 multiplication and rounding are the same
in torch and numpy, so every pixel equals diffusers' own; ``tests/runtime/test_postprocess.py`` compares them.
Anything but a ``pil`` request of a 4-D tensor goes to diffusers' method untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from PIL import Image

from ditq.runtime.stage_clock import shadowed

__all__ = ["pixels_on_device", "to_pil"]


def to_pil(denormalized: torch.Tensor) -> list[Image.Image]:
    """(B, C, H, W) in [0, 1], any float dtype and device -> B images, as diffusers' ``pt_to_numpy`` then
    ``numpy_to_pil`` make them (one channel: mode L)."""
    # (B, C, H, W) -> (B, H, W, C) uint8, on the tensor's device; then one copy to the host
    pixels = denormalized.permute(0, 2, 3, 1).float().mul(255).round().to(torch.uint8).cpu().numpy()
    return [Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image) for image in pixels]


def _postprocess(processor: Any, original: Callable[..., Any]) -> Callable[..., Any]:
    def postprocess(image: Any, output_type: str = "pil", do_denormalize: Any = None) -> Any:
        if output_type != "pil" or not isinstance(image, torch.Tensor) or image.ndim != 4:
            return original(image, output_type=output_type, do_denormalize=do_denormalize)
        return to_pil(processor._denormalize_conditionally(image, do_denormalize))

    return postprocess


@contextmanager
def pixels_on_device(pipeline: Any) -> Iterator[None]:
    """For the length of the block, ``pipeline.image_processor.postprocess`` makes its PIL images on the device
    (module docstring); a pipeline without a diffusers image processor is untouched."""
    processor = getattr(pipeline, "image_processor", None)
    original = getattr(processor, "postprocess", None)
    if not callable(original) or not callable(getattr(processor, "_denormalize_conditionally", None)):
        yield
        return
    with shadowed(processor, "postprocess", _postprocess(processor, original)):
        yield
