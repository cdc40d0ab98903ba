"""Uploaded images (issue 15, cases 2 and 3): only the PNG, JPEG and WebP decoders run, pixel caps are read from
the header before decoding, and the worker decodes a queued request's images just before it runs."""

from __future__ import annotations

import dataclasses
import io
import os
import struct
import threading
import zlib
from pathlib import Path
from typing import Any

import pytest
from PIL import EpsImagePlugin, Image
from serve_testkit import FAST, WARN, GatedAdapter, client_for, make_app, png_bytes, tiny_adapter

from ditq.serve import worker as worker_module

EDITS = "/v1/images/edits"
EPS = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 16 16\nnewpath 0 0 moveto 16 16 lineto stroke\nshowpage\n"


def edit(client: Any, images: list[tuple[str, bytes]], **fields: str) -> Any:
    data = {"prompt": "make it blue", "size": "32x32", "num_inference_steps": "1", **fields}
    files = [("image[]", (name, content, "application/octet-stream")) for name, content in images]
    return client.post(EDITS, data=data, files=files)


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height over one tiny (truncated) IDAT chunk."""

    def chunk(kind: bytes, payload: bytes) -> bytes:
        return (
            struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))
        )

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64))


@pytest.fixture(scope="module")
def client() -> Any:
    config = dataclasses.replace(WARN, max_image_pixels=96 * 96, max_upload_pixels=2 * 80 * 80)
    with client_for(make_app(config)) as client:
        yield client


@pytest.fixture
def stand_in_ghostscript(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A `gs` on PATH that records every call (the attack's stand-in), found by Pillow afresh."""
    marker = tmp_path / "gs-calls.txt"
    gs = tmp_path / "bin" / "gs"
    gs.parent.mkdir()
    gs.write_text(f'#!/bin/sh\necho "$@" >> {marker}\n')
    gs.chmod(0o755)
    monkeypatch.setenv("PATH", f"{gs.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(EpsImagePlugin, "gs_binary", None)
    return marker


def test_eps_upload_never_reaches_ghostscript(client: Any, stand_in_ghostscript: Path) -> None:
    # The oracle: Pillow left to itself runs the stand-in for this upload.
    with pytest.raises(OSError), Image.open(io.BytesIO(EPS)) as image:
        image.load()
    assert "-sDEVICE" in stand_in_ghostscript.read_text()
    stand_in_ghostscript.unlink()

    response = edit(client, [("drawing.png", EPS)])
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "image" and "not a PNG, JPEG or WebP image" in error["message"]
    assert "/tmp" not in error["message"] and "gs" not in error["message"].split()
    assert not stand_in_ghostscript.exists()  # Ghostscript never ran


@pytest.mark.parametrize("format_name", ["GIF", "BMP", "TIFF", "ICO"])
def test_other_decoders_are_refused(client: Any, format_name: str) -> None:
    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), (10, 200, 30)).save(buffer, format=format_name)
    response = edit(client, [(f"a.{format_name.lower()}", buffer.getvalue())])
    assert response.status_code == 400 and "not a PNG, JPEG or WebP" in response.json()["error"]["message"]


@pytest.mark.parametrize("format_name", ["PNG", "JPEG", "WEBP"])
def test_allowed_decoders_are_served(client: Any, format_name: str) -> None:
    buffer = io.BytesIO()
    Image.new("RGB", (40, 24), (10, 200, 30)).save(buffer, format=format_name)
    response = edit(client, [(f"a.{format_name.lower()}", buffer.getvalue())])
    assert response.status_code == 200, response.text


def test_an_image_over_the_pixel_cap_is_refused_from_its_header(client: Any) -> None:
    # 97x97 is one row over the cap of 96*96; a 1.4 MB PNG of 9400x9400 is the same at scale
    response = edit(client, [("big.png", png_bytes(97, 97))])
    assert response.status_code == 400
    assert "97x97 = 9409 pixels, above 9216" in response.json()["error"]["message"]


def test_a_header_past_pillows_bomb_limit_is_400_not_a_decode(client: Any) -> None:
    bomb = png_header_only(30000, 30000)  # 900 megapixels claimed in 100 bytes
    response = edit(client, [("bomb.png", bomb)])
    assert response.status_code == 400 and "more pixels than 9216" in response.json()["error"]["message"]


def test_uploads_over_the_per_request_cap_together_are_refused(client: Any) -> None:
    # each 90x90 image is under the per-image cap, two of them pass the request's 2*80*80
    response = edit(client, [("a.png", png_bytes(90, 90)), ("b.png", png_bytes(90, 90))])
    assert response.status_code == 400
    assert "above the limit of 12800" in response.json()["error"]["message"]


def test_a_truncated_image_is_400_from_the_worker_naming_it(client: Any) -> None:
    whole = png_bytes(64, 64, colour=(1, 2, 3, 255))
    truncated = whole[: len(whole) // 2]  # header intact, pixel data cut
    response = edit(client, [("cut.png", truncated)])
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "image" and "cut.png" in error["message"] and "decoded" in error["message"]


def test_queued_images_are_bytes_and_the_worker_decodes_them(monkeypatch: pytest.MonkeyPatch) -> None:
    decoded_on: list[str] = []
    decode = worker_module.decode_references

    def recording(references: Any) -> Any:
        decoded_on.append(threading.current_thread().name)
        return decode(references)

    monkeypatch.setattr(worker_module, "decode_references", recording)
    gated = GatedAdapter(tiny_adapter())
    app = make_app(load=lambda: gated)
    with client_for(app) as client:
        first = threading.Thread(
            target=client.post, args=("/v1/images/generations",), kwargs={"json": FAST | {"prompt": "hold"}}
        )
        first.start()
        assert gated.entered.acquire(timeout=30)
        statuses: list[int] = []
        queued = threading.Thread(
            target=lambda: statuses.append(edit(client, [("a.png", png_bytes())]).status_code)
        )
        queued.start()
        worker = app.state.serve.worker
        while worker.queue_depth < 1:
            threading.Event().wait(0.02)
        job = worker._waiting[0]
        assert job.request.images == [] and isinstance(job.references[0].data, bytes)  # nothing decoded yet
        gated.release.set()
        first.join(60)
        queued.join(60)
        assert statuses == [200] and decoded_on == ["generation-worker"]
