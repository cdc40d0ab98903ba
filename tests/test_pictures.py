"""One opener for every picture ditq reads (``ditq.pictures``): PNG, JPEG and WebP by signature, the pixel count
bounded from the header before a pixel is decoded; everything else one line naming the picture. And the readers
that use it: ``ditq fixtures init`` (pictures and the prompts file), compare's image loader."""

from __future__ import annotations

import io
import os
import struct
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
from PIL import Image

from ditq.cli import main
from ditq.errors import InputError

EPS = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nnewpath 0 0 moveto 10 10 lineto stroke\nshowpage\n"


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_bomb(width: int, height: int, rows: bool) -> bytes:
    """A one-bit greyscale PNG of ``width`` x ``height``: its zero rows deflated (a few hundred kB for 30000
    squared), or with ``rows`` False its header alone."""
    head = b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0))
    if not rows:
        return head + _chunk(b"IEND", b"")
    packer, row = zlib.compressobj(9), b"\x00" * (1 + (width + 7) // 8)
    body = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()
    return head + _chunk(b"IDAT", body) + _chunk(b"IEND", b"")


def _png(size: tuple[int, int] = (16, 16)) -> bytes:
    buffer = io.BytesIO()
    Image.effect_noise(size, 64).convert("RGB").save(buffer, format="PNG")  # noise: deflate keeps it long
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("data", "said"),
    [
        (EPS, "not a PNG, JPEG or WebP picture"),
        (b"GIF89a" + b"\x00" * 64, "not a PNG, JPEG or WebP picture"),
        (png_bomb(30000, 30000, rows=True), "pixels"),
        (png_bomb(20000, 20000, rows=False), "pixels"),
        (png_bomb(9000, 9000, rows=False), "above 67108864"),
        (_png((64, 64))[:2000], "not a readable PNG picture"),
    ],
    ids=["EPS named .png", "GIF", "30000x30000 PNG", "20000x20000 header", "above ditq's bound", "truncated"],
)
def test_the_opener_refuses_in_one_line(data: bytes, said: str, tmp_path: Path) -> None:
    from ditq.pictures import open_picture

    path = tmp_path / "p.png"
    path.write_bytes(data)
    with pytest.raises(InputError) as refused:
        open_picture(path)
    message = str(refused.value)
    assert message.startswith(f"{path}: ") and said in message and "\n" not in message


def test_the_opener_reads_png_jpeg_and_webp_whatever_their_names(tmp_path: Path) -> None:
    from ditq.pictures import open_picture

    for form in ("PNG", "JPEG", "WEBP"):
        path = tmp_path / "named-wrongly.gif"
        Image.new("RGB", (24, 16), "blue").save(path, format=form)
        with open_picture(path) as image:
            assert image.size == (24, 16) and image.format in (form, "MPO")


def test_compare_reads_run_images_through_the_opener() -> None:
    from ditq.metrics import load_png_array

    with pytest.raises(InputError, match="not a PNG, JPEG or WebP picture"):
        load_png_array(EPS)
    assert load_png_array(_png())[0].shape == (16, 16, 3)


def _folder(tmp_path: Path, picture: bytes = b"", prompts: str = "one [p]: the picture, but blue\n") -> Path:
    folder = tmp_path / "pics"
    folder.mkdir()
    (folder / "p.png").write_bytes(picture or _png())
    (folder / "prompts.txt").write_text(prompts)
    return folder


def _fifo_prompts(tmp_path: Path) -> list[str]:
    folder = _folder(tmp_path)
    (folder / "prompts.txt").unlink()
    os.mkfifo(folder / "prompts.txt")
    return [str(folder)]


CRAFTS: dict[str, tuple[Callable[[Path], list[str]], str]] = {
    "30000x30000 PNG": (lambda t: [str(_folder(t, png_bomb(30000, 30000, rows=True)))], "pixels"),
    "EPS named p.png": (lambda t: [str(_folder(t, EPS))], "not a PNG, JPEG or WebP picture"),
    "FIFO prompts.txt": (_fifo_prompts, "not a regular file (a FIFO)"),
    "--prompts /dev/zero": (lambda t: [str(_folder(t)), "--prompts", "/dev/zero"], "not a regular file"),
    "a prompts file over 1 MiB": (
        lambda t: [str(_folder(t, prompts="one [p]: " + "word " * 300_000 + "\n"))],
        "larger than 1 MiB",
    ),
}


@pytest.mark.parametrize("name", list(CRAFTS))
def test_fixtures_init_refuses_hostile_pictures_and_text_in_one_line(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    craft, said = CRAFTS[name]
    argv = craft(tmp_path)
    started = time.monotonic()
    assert main(["fixtures", "init", *argv, "--size", "32x32"]) == 2
    assert time.monotonic() - started < 30  # nothing hangs on a FIFO or reads /dev/zero to its end
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and said in lines[0], lines
    assert not (tmp_path / "pics" / "fixtures").exists()


def test_a_byte_order_mark_is_not_part_of_the_first_line(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    (folder / "prompts.txt").write_bytes("\ufeffone [p]: the picture, but blue\n".encode())
    assert main(["fixtures", "init", str(folder), "--size", "32x32"]) == 0
    assert (folder / "fixtures" / "fixtures.json").is_file()
