"""Pictures ditq reads from files others wrote: a fixtures folder's pictures, reference images, a run's images.

One opener for all of them (``open_picture``). Only PNG, JPEG and WebP are decoded, each chosen by its signature
(the file's first bytes, never its name), so no other Pillow plugin ever sees the bytes (EPS would start
Ghostscript, an interpreter, on them). The file is a regular file of at most ``MAX_PICTURE_BYTES``, and its width
times height, read from the header, is at most ``MAX_PICTURE_PIXELS`` before a pixel is decoded. Anything else is
an InputError of one line naming the picture.
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path

from PIL import Image

from ditq.errors import InputError
from ditq.fsutil import read_bounded

__all__ = ["MAX_PICTURE_BYTES", "MAX_PICTURE_PIXELS", "open_picture", "picture_format", "read_picture_bytes"]

MAX_PICTURE_BYTES = 256 << 20  # about what an 8192x8192 RGBA PNG of noise takes
MAX_PICTURE_PIXELS = 8192 * 8192  # below Pillow's own bomb limit (89 M pixels), which warns and then refuses
_WEBP = b"WEBP"


def picture_format(data: bytes) -> str | None:
    """ "PNG", "JPEG" or "WEBP" by the bytes' signature; None for anything else."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if data[:4] == b"RIFF" and data[8:12] == _WEBP:
        return "WEBP"
    return None


def read_picture_bytes(path: Path) -> bytes:
    """The bytes of the picture file ``path``: a regular file of at most ``MAX_PICTURE_BYTES``."""
    return read_bounded(Path(path), MAX_PICTURE_BYTES)


def open_picture(
    source: Path | bytes, name: str | None = None, max_pixels: int = MAX_PICTURE_PIXELS
) -> Image.Image:
    """The picture at ``source`` (a path, or bytes named ``name``), decoded; a file that is not a PNG, JPEG or WebP
    by its signature, holds more than ``max_pixels`` pixels by its header, or does not decode is an InputError
    naming it."""
    if isinstance(source, bytes):
        data, where = source, name or "picture"
    else:
        data, where = read_picture_bytes(source), name or str(source)
    found = picture_format(data)
    if found is None:
        raise InputError(f"{where}: not a PNG, JPEG or WebP picture (by its first bytes)")
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(data), formats=(found,))
        except (Image.DecompressionBombWarning, Image.DecompressionBombError):
            raise InputError(f"{where}: more than {max_pixels} pixels; not a picture ditq reads") from None
        except (OSError, SyntaxError, ValueError) as error:  # UnidentifiedImageError is an OSError
            raise InputError(f"{where}: not a readable {found} picture ({type(error).__name__})") from None
        width, height = image.size
        if width * height > max_pixels:
            image.close()
            raise InputError(
                f"{where}: {width}x{height} is {width * height} pixels, above {max_pixels}; not a picture ditq reads"
            )
        try:
            image.load()
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombWarning) as error:
            image.close()
            raise InputError(f"{where}: not a readable {found} picture ({type(error).__name__})") from None
    return image
