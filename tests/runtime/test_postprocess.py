"""Images made on the device (``ditq.runtime.postprocess``): every pixel equals diffusers' own ``postprocess``."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers.image_processor import VaeImageProcessor

from ditq.runtime.postprocess import pixels_on_device

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _decoded(dtype: torch.dtype, channels: int = 3) -> torch.Tensor:
    """A decode's output (B, C, H, W) in [-1, 1], with values at the rounding boundaries (k + 0.5) / 255 too."""
    generator = torch.Generator().manual_seed(2301)
    image = torch.rand(2, channels, 48, 40, generator=generator) * 2.2 - 1.1  # a little outside [-1, 1] too
    halves = (torch.arange(256, dtype=torch.float64) + 0.5) / 255 * 2 - 1
    image.view(-1)[: halves.numel()] = halves.float()
    return image.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("channels", [3, 1])
def test_pixels_made_on_the_device_equal_diffusers_own(dtype: torch.dtype, channels: int) -> None:
    processor = VaeImageProcessor(vae_scale_factor=16)
    image = _decoded(dtype, channels)
    expected = processor.postprocess(image, output_type="pil")
    with pixels_on_device(SimpleNamespace(image_processor=processor)):
        made = processor.postprocess(image, output_type="pil")
        tensor = processor.postprocess(image, output_type="pt")  # other output types: diffusers' own
    assert processor.postprocess.__self__ is processor  # put back after the block
    assert [m.mode for m in made] == [e.mode for e in expected]
    for mine, theirs in zip(made, expected, strict=True):
        assert np.array_equal(np.asarray(mine), np.asarray(theirs))
    assert torch.equal(tensor, processor.postprocess(image, output_type="pt"))


def test_a_pipeline_without_an_image_processor_is_untouched() -> None:
    pipeline = SimpleNamespace()
    with pixels_on_device(pipeline):
        assert not hasattr(pipeline, "image_processor")
