"""Uploaded reference images: checked from their headers on arrival, decoded by the worker just before use.

Only three decoders are ever run: PNG, JPEG and WebP (``Image.open(..., formats=...)``), so an upload
never reaches Pillow's other plugins (EPS starts Ghostscript, for one). Width and height come from the
header; an image over ``max_image_pixels``, or uploads over ``max_upload_pixels`` together, are refused
before a pixel is decoded. A queued request holds the compressed bytes only; the generation worker
decodes them (one request at a time) right before the pipeline runs, and a decode failure there is
still a 400 naming the image.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

from PIL import Image

from ditq.errors import InputError
from ditq.runtime.adapter import PipelineAdapter
from ditq.serve.config import ServeConfig
from ditq.serve.errors import bad_field

__all__ = ["ALLOWED_FORMATS", "Reference", "Upload", "check_uploads", "decode_references"]

# The decoders tried, in order; "MPO" is what Pillow's JPEG decoder calls a camera's multi-picture JPEG.
ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP")
_OPENED_AS = {*ALLOWED_FORMATS, "MPO"}


@dataclass(frozen=True)
class Upload:
    """One uploaded file: the multipart field it came in, its file name and its bytes."""

    field: str
    filename: str
    data: bytes


@dataclass(frozen=True)
class Reference:
    """An upload whose header passed: its format and size are known, its pixels not decoded yet."""

    name: str  # 'image[] #2 (cat.png)', as errors name it
    data: bytes
    format: str
    width: int
    height: int

    @property
    def pixels(self) -> int:
        return self.width * self.height


def _open(data: bytes) -> Image.Image:
    """The header read by an allowed decoder only; Pillow's bomb check turned into an error."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        return Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS)


def _check_one(index: int, upload: Upload, config: ServeConfig) -> Reference:
    name = f"{upload.field} #{index + 1} ({upload.filename[:64] or 'unnamed'})"
    if not upload.data:
        raise bad_field("image", f"{name} is empty (0 bytes)")
    try:
        image = _open(upload.data)
    except (Image.DecompressionBombWarning, Image.DecompressionBombError):
        raise bad_field("image", f"{name} has more pixels than {config.max_image_pixels}") from None
    except (OSError, SyntaxError, ValueError):  # UnidentifiedImageError is an OSError
        raise bad_field("image", f"{name} is not a PNG, JPEG or WebP image") from None
    with image:
        format_name, (width, height) = image.format or "", image.size
    if format_name not in _OPENED_AS:
        raise bad_field("image", f"{name} is {format_name}, not PNG, JPEG or WebP")
    if width * height > config.max_image_pixels:
        raise bad_field(
            "image", f"{name} is {width}x{height} = {width * height} pixels, above {config.max_image_pixels}"
        )
    return Reference(name, upload.data, format_name, width, height)


def check_uploads(uploads: list[Upload], adapter: PipelineAdapter, config: ServeConfig) -> list[Reference]:
    """Count, decoder and pixel caps from the headers; raises a 400 naming the image. Reads no pixel data."""
    limit = adapter.max_reference_images
    if limit == 0:
        raise bad_field("image", f"the served pipeline ({adapter.pipeline_name}) takes no reference image")
    if not uploads:
        raise bad_field("image", "at least one image is required (multipart field 'image' or 'image[]')")
    if len(uploads) > limit:
        raise bad_field("image", f"{len(uploads)} images given, the served pipeline takes at most {limit}")
    references = [_check_one(index, upload, config) for index, upload in enumerate(uploads)]
    total = sum(reference.pixels for reference in references)
    if total > config.max_upload_pixels:
        raise bad_field(
            "image", f"the images hold {total} pixels together, above the limit of {config.max_upload_pixels}"
        )
    return references


def decode_references(references: tuple[Reference, ...]) -> list[Image.Image]:
    """Every reference decoded (on the worker's thread); a truncated or corrupt one is an InputError that
    the HTTP layer answers as a 400 naming it."""
    images: list[Image.Image] = []
    for reference in references:
        try:
            image = _open(reference.data)
            image.load()
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombWarning) as error:
            raise InputError(
                f"image: {reference.name} could not be decoded ({type(error).__name__})", field="image"
            ) from None
        images.append(image)
    return images
