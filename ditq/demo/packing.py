"""Exact image <-> token packing: pixel-unshuffle of RGBA pixels, no autoencoder.

A (H, W) RGBA image becomes (H/4 * W/4) tokens of 4*4*4 = 64 channels in [-1, 1], row-major over the token grid,
which is the layout `QwenImage21Transformer2DModel` reads (in_channels=64, patch_size=1).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

__all__ = [
    "PIXELS_PER_TOKEN",
    "TOKEN_CHANNELS",
    "pil_to_pixels",
    "pixels_to_pil",
    "pixels_to_tokens",
    "tokens_to_pixels",
]

PIXELS_PER_TOKEN = 4  # one token covers a 4x4 pixel tile
TOKEN_CHANNELS = 4 * PIXELS_PER_TOKEN * PIXELS_PER_TOKEN  # RGBA x 4 x 4 = 64


def pil_to_pixels(image: Image.Image, size: tuple[int, int] | None = None) -> torch.Tensor:
    """PIL image -> (4, H, W) float32 RGBA in [-1, 1]; resized to `size` (width, height) when given."""
    image = image.convert("RGBA")
    if size is not None and image.size != size:
        image = image.resize(size, Image.Resampling.BILINEAR)
    array = np.asarray(image, dtype=np.float32)  # (H, W, 4) in 0..255
    return torch.from_numpy(array).permute(2, 0, 1) / 127.5 - 1.0


def pixels_to_pil(pixels: torch.Tensor) -> Image.Image:
    """(4, H, W) RGBA in [-1, 1] -> RGBA PIL image (values clamped)."""
    array = ((pixels.float().clamp(-1, 1) + 1.0) * 127.5).round().to(torch.uint8)
    return Image.fromarray(array.permute(1, 2, 0).cpu().numpy(), mode="RGBA")


def pixels_to_tokens(pixels: torch.Tensor) -> torch.Tensor:
    """(B, 4, H, W) -> (B, H/4 * W/4, 64); H and W must be multiples of 4."""
    _, channels, height, width = pixels.shape
    if channels != 4 or height % PIXELS_PER_TOKEN or width % PIXELS_PER_TOKEN:
        raise ValueError(f"pixels must be (B, 4, H, W) with H, W multiples of 4, got {tuple(pixels.shape)}")
    grid = F.pixel_unshuffle(pixels, PIXELS_PER_TOKEN)  # (B, 64, H/4, W/4)
    return grid.flatten(2).transpose(1, 2)


def tokens_to_pixels(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """(B, H/4 * W/4, 64) -> (B, 4, H, W); the exact inverse of `pixels_to_tokens`."""
    batch = tokens.shape[0]
    grid = tokens.transpose(1, 2).reshape(
        batch, TOKEN_CHANNELS, height // PIXELS_PER_TOKEN, width // PIXELS_PER_TOKEN
    )
    return F.pixel_shuffle(grid, PIXELS_PER_TOKEN)
