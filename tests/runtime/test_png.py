"""ditq's PNG writer: PIL decodes every mode to the exact pixels, and the joined slices are one valid zlib stream."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from ditq.runtime import png
from ditq.runtime.images import encode_image
from ditq.runtime.png import encode_png


def _pixels(height: int, width: int, channels: int, seed: int = 0, noise: float = 40.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    smooth = np.linspace(0, 255, width, dtype=np.float64)[None, :, None] + np.zeros((height, 1, channels))
    noisy = smooth + rng.normal(0, noise, (height, width, channels))
    return np.clip(noisy, 0, 255).astype(np.uint8)


def _chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    chunks, at = [], 8
    while at < len(data):
        (length,) = struct.unpack(">I", data[at : at + 4])
        kind, body = data[at + 4 : at + 8], data[at + 8 : at + 8 + length]
        (crc,) = struct.unpack(">I", data[at + 8 + length : at + 12 + length])
        assert crc == zlib.crc32(kind + body), kind
        chunks.append((kind, body))
        at += 12 + length
    return chunks


@pytest.mark.parametrize(("channels", "mode"), [(1, "L"), (2, "LA"), (3, "RGB"), (4, "RGBA")])
@pytest.mark.parametrize(("height", "width"), [(1, 1), (3, 5), (64, 48)])
def test_pil_decodes_the_exact_pixels(channels: int, mode: str, height: int, width: int) -> None:
    pixels = _pixels(height, width, channels)
    decoded = Image.open(io.BytesIO(encode_png(pixels)))
    assert decoded.mode == mode and decoded.size == (width, height)
    back = np.asarray(decoded)
    assert np.array_equal(back.reshape(height, width, channels), pixels)


def test_slices_on_several_threads_join_into_one_checked_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(png, "_workers", lambda: 5)
    monkeypatch.setattr(png, "_MIN_SLICE", 1024)
    slices: list[int] = []
    deflate = png._deflate
    monkeypatch.setattr(png, "_deflate", lambda data, last: slices.append(len(data)) or deflate(data, last))
    pixels = _pixels(301, 200, 4, seed=1)
    data = encode_png(pixels)
    chunks = _chunks(data)
    assert [kind for kind, _ in chunks] == [b"IHDR", b"IDAT", b"IEND"]
    # zlib.decompress checks the adler32 trailer, which PIL's decoder does not read
    rows = zlib.decompress(chunks[1][1])
    assert rows == png._filtered_rows(pixels).tobytes()
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(data))), pixels)
    # five slices of 301 rows of 801 bytes: the boundaries fall inside rows, and the stream still decodes
    assert len(slices) == 5 and sum(slices) == 301 * 801 and any(size % 801 for size in slices)


def test_smooth_pictures_shrink_about_as_much_as_pil_makes_them() -> None:
    pixels = _pixels(256, 256, 3, seed=2, noise=3.0)
    ours = encode_png(pixels)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG", compress_level=1)
    assert len(ours) < pixels.nbytes * 0.9  # the filter and deflate do compress
    assert len(ours) < len(buffer.getvalue()) * 1.15


@pytest.mark.parametrize(
    "pixels",
    [
        np.zeros((4, 4, 3), np.float32),
        np.zeros((4, 4), np.uint8),
        np.zeros((4, 4, 5), np.uint8),
        np.zeros((0, 4, 3), np.uint8),
    ],
)
def test_other_arrays_are_refused(pixels: np.ndarray) -> None:
    with pytest.raises(ValueError, match="encode_png takes"):
        encode_png(pixels)


def test_a_palette_transparency_still_reaches_the_answer() -> None:
    """An image whose transparency is a tRNS entry rather than an alpha channel goes through PIL's writer."""
    image = Image.new("RGB", (8, 8), (10, 20, 30))
    image.info["transparency"] = (10, 20, 30)
    decoded = Image.open(io.BytesIO(encode_image(image, "png", "auto")))
    assert decoded.info.get("transparency") == (10, 20, 30)
    assert np.array_equal(np.asarray(decoded.convert("RGB")), np.asarray(image))


def test_a_forked_child_encodes_with_threads_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    import multiprocessing

    monkeypatch.setattr(png, "_workers", lambda: 2)
    monkeypatch.setattr(png, "_MIN_SLICE", 1024)
    pixels = _pixels(64, 64, 3, seed=3)
    expected = encode_png(pixels)  # the parent's pool now exists
    context = multiprocessing.get_context("fork")
    with context.Pool(1) as pool:
        assert pool.apply_async(encode_png, (pixels,)).get(timeout=60) == expected
