"""Generated images on their way out: the collapse check, then encoding as png, jpeg or webp (as ``ditq serve``
answers, ``ditq generate`` writes and the in-process baseline records them)."""

from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from PIL import Image

from ditq.metrics import structure_metrics
from ditq.runtime.png import encode_png
from ditq.signatures import GateRules

__all__ = ["checked_and_encoded", "collapse_reasons", "encode_image"]

_SAVE_OPTIONS: dict[str, dict[str, object]] = {
    # what PIL writes where ditq's own PNG writer (ditq.runtime.png) does not: an image with a palette transparency
    "png": {"format": "PNG", "compress_level": 1},
    "jpeg": {"format": "JPEG", "quality": 95},
    "webp": {"format": "WEBP", "quality": 95},
}


def collapse_reasons(image: Image.Image, rules: GateRules) -> list[str]:
    """The gate's collapse signatures this image shows (``name: measured values``); empty when sound.

    Non-finite latents reach a PIL image as black or transparent pixels, which the flat and
    transparent signatures catch.
    """
    structure = structure_metrics(np.asarray(image))
    return [sig.describe(structure) for sig in rules.signatures if sig.fires(structure)]


def _over_white(image: Image.Image) -> Image.Image:
    rgba = image.convert("RGBA")
    background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(background, rgba).convert("RGB")


def takes_quality(output_format: str) -> bool:
    """Whether ``output_format``'s encoder takes a quality (``output_compression``); PNG is lossless."""
    return "quality" in _SAVE_OPTIONS[output_format]


def encode_image(
    image: Image.Image, output_format: str, background: str, output_compression: int | None = None
) -> bytes:
    """Encode one image. background: 'opaque' flattens over white, 'transparent' keeps an alpha
    channel (adding an opaque one if there is none), 'auto' keeps what the pipeline produced where the
    format can hold it (jpeg cannot hold alpha: flattened over white). ``output_compression`` (0-100, OpenAI's
    field) is the jpeg or webp encoder's quality; png is lossless and has none."""
    has_alpha = "A" in image.getbands() or "transparency" in image.info
    if background == "opaque" or (has_alpha and output_format == "jpeg"):
        image = _over_white(image) if has_alpha else image.convert("RGB")
    elif background == "transparent":
        image = image.convert("RGBA")
    elif image.mode not in ("RGB", "RGBA", "L", "LA"):
        image = image.convert("RGBA" if has_alpha else "RGB")
    if output_format == "png" and "transparency" not in image.info:
        # the largest part of a 1024x1024 answer's postprocessing, on several threads (docs/results.md, "Served speed")
        pixels = np.asarray(image)
        return encode_png(pixels if pixels.ndim == 3 else pixels[:, :, None])
    options = dict(_SAVE_OPTIONS[output_format])
    if output_compression is not None and takes_quality(output_format):
        options["quality"] = output_compression
    buffer = io.BytesIO()
    image.save(buffer, **options)  # type: ignore[arg-type]
    return buffer.getvalue()


def checked_and_encoded(
    images: list[Image.Image],
    rules: GateRules,
    output_format: str,
    background: str,
    output_compression: int | None = None,
) -> tuple[list[list[str]], list[bytes]]:
    """Each image's collapse reasons (``collapse_reasons``) and its encoding (``encode_image``), the checks on a
    thread of their own while this one encodes: both are numpy and zlib work that lets go of the GIL, about 25 and
    18 ms of a 1024x1024 answer on an H100 host. An image that collapsed is encoded all the same (the caller decides
    whether to answer with it)."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ditq-collapse") as pool:
        reasons = pool.map(collapse_reasons, images, [rules] * len(images))
        encoded = [encode_image(image, output_format, background, output_compression) for image in images]
        return list(reasons), encoded
