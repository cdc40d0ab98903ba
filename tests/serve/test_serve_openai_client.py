"""The official `openai` client against a live server on loopback: generations, edits, seeds; and on the same
server, what other HTTP clients do: HEAD /health, a client that half-closes after its request."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from PIL import Image
from serve_testkit import FAST, WARN, LiveServer, make_app, png_bytes

EXTRA = {"num_inference_steps": 2}


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    app = make_app()
    with LiveServer(app) as live:
        assert app.state.serve.wait_loaded(120)
        yield live


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def decode(b64: str | None) -> Image.Image:
    assert b64 is not None
    return Image.open(io.BytesIO(base64.b64decode(b64)))


def test_models_lists_the_served_name(client: openai.OpenAI) -> None:
    assert [model.id for model in client.models.list()] == ["tiny"]


def test_generate_returns_images_of_the_asked_size_with_stage_metrics(client: openai.OpenAI) -> None:
    result = client.images.generate(
        model="tiny",
        prompt="a red square",
        n=2,
        size="48x32",
        response_format="b64_json",
        extra_body={"seed": 7, "return_stage_metrics": True, **EXTRA},
    )
    assert result.data is not None and len(result.data) == 2
    for item in result.data:
        image = decode(item.b64_json)
        assert image.size == (48, 32) and image.format == "PNG"
    body = result.model_dump()
    assert body["size"] == "48x32" and body["output_format"] == "png"
    metrics = body["metrics"]
    assert len(metrics["denoise_step_latencies_ms"]) == 2
    assert metrics["denoising_ms"] > 0 and metrics["text_encoding_ms"] > 0 and metrics["queue_wait_ms"] >= 0
    usage = {key: body["usage"][key] for key in ("input_images", "output_images", "output_pixels")}
    assert usage == {"input_images": 0, "output_images": 2, "output_pixels": 2 * 48 * 32}


def test_seed_zero_is_reproducible_and_differs_from_seed_one(client: openai.OpenAI) -> None:
    def one(seed: int) -> str | None:
        result = client.images.generate(
            model="tiny", prompt="a blue circle", size="32x32", extra_body={"seed": seed, **EXTRA}
        )
        assert result.data is not None
        return result.data[0].b64_json

    first = one(0)
    assert one(0) == first
    assert one(1) != first


@pytest.mark.parametrize("count", [1, 4])
def test_edit_with_one_and_four_images(client: openai.OpenAI, count: int) -> None:
    images = [(f"ref{i}.png", png_bytes(colour=(40 * i, 90, 200, 255)), "image/png") for i in range(count)]
    result = client.images.edit(
        model="tiny",
        image=images if count > 1 else images[0],
        prompt="put them together",
        size="32x48",
        output_format="webp",
        extra_body={"seed": 0, **EXTRA},
    )
    assert result.data is not None and len(result.data) == 1
    image = decode(result.data[0].b64_json)
    assert image.size == (32, 48) and image.format == "WEBP"
    assert result.model_dump()["usage"]["input_images"] == count


def test_edit_seed_zero_is_reproducible(client: openai.OpenAI) -> None:
    def one() -> str | None:
        result = client.images.edit(
            model="tiny",
            image=[("a.png", png_bytes(), "image/png")] * 2,
            prompt="make it dusk",
            size="32x32",
            extra_body={"seed": 0, **EXTRA},
        )
        assert result.data is not None
        return result.data[0].b64_json

    assert one() == one()


def test_errors_reach_the_client_as_openai_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.images.generate(model="tiny", prompt="x", size="33x33", extra_body=EXTRA)
    assert caught.value.code == "invalid_value" and caught.value.param == "size"


def test_fields_that_cannot_change_the_image_are_accepted_and_recorded(
    client: openai.OpenAI, server: LiveServer
) -> None:
    """Issue 29: quality, style, user... were 400 unknown fields. Now the image is the one asked for without them,
    and the response and /metrics name them."""
    plain = client.images.generate(
        model="tiny", prompt="a kite", size="32x32", extra_body={"seed": 3, **EXTRA}
    )
    asked = client.images.generate(
        model="tiny",
        prompt="a kite",
        size="32x32",
        quality="high",
        style="vivid",
        moderation="low",
        user="x",
        extra_body={"seed": 3, **EXTRA},
    )
    assert asked.data is not None and plain.data is not None
    assert asked.data[0].b64_json == plain.data[0].b64_json
    assert asked.model_dump()["ignored_fields"] == ["quality", "style", "moderation", "user"]
    assert plain.model_dump()["ignored_fields"] == []
    edited = client.images.edit(
        model="tiny",
        image=("a.png", png_bytes(), "image/png"),
        prompt="make it dusk",
        size="32x32",
        quality="low",
        input_fidelity="high",
        safety_identifier="hashed-id",
        extra_body=EXTRA,
    )
    assert edited.model_dump()["ignored_fields"] == ["quality", "input_fidelity", "safety_identifier"]
    text = httpx.get(f"{server.base_url}/metrics").text
    assert 'ditq_ignored_fields_total{field="input_fidelity"} 1' in text


def test_null_is_an_omitted_field(client: openai.OpenAI) -> None:
    """OpenAI's fields are optional, and clients send null for "not set"; n null was a 400."""
    result = client.images.generate(
        model="tiny", prompt="a kite", n=None, quality=None, stream=None, size="32x32", extra_body=EXTRA
    )
    assert result.data is not None and len(result.data) == 1
    assert result.model_dump()["ignored_fields"] == []


def test_output_compression_is_the_jpeg_quality_and_ignored_for_png(client: openai.OpenAI) -> None:
    def one(output_format: str, compression: int) -> tuple[int, list[str]]:
        result = client.images.generate(
            model="tiny",
            prompt="a kite",
            size="64x64",
            output_format=output_format,  # type: ignore[arg-type]
            output_compression=compression,
            extra_body={"seed": 5, **EXTRA},
        )
        assert result.data is not None and result.data[0].b64_json is not None
        return len(base64.b64decode(result.data[0].b64_json)), result.model_dump()["ignored_fields"]

    assert one("jpeg", 5)[0] < one("jpeg", 95)[0]
    assert one("png", 5) == (one("png", 95)[0], ["output_compression"])


@pytest.mark.parametrize(
    ("endpoint", "fields", "param"),
    [
        ("generate", {"stream": True}, "stream"),
        ("generate", {"partial_images": 2}, "partial_images"),
        ("edit", {"mask": ("m.png", png_bytes(), "image/png")}, "mask"),
        ("edit", {"stream": True}, "stream"),
    ],
)
def test_fields_asking_for_what_is_not_made_are_refused_naming_them(
    client: openai.OpenAI, endpoint: str, fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        if endpoint == "generate":
            client.images.generate(model="tiny", prompt="a kite", size="32x32", extra_body=EXTRA, **fields)
        else:
            image = ("a.png", png_bytes(), "image/png")
            client.images.edit(
                model="tiny", image=image, prompt="x", size="32x32", extra_body=EXTRA, **fields
            )
    assert caught.value.status_code == 400
    assert caught.value.code == "unsupported_parameter" and caught.value.param == param


def test_health_and_metrics_over_http(server: LiveServer) -> None:
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    text = httpx.get(f"{server.base_url}/metrics").text
    assert 'ditq_requests_total{endpoint="generations",status="200"}' in text
    assert "ditq_request_latency_seconds_bucket" in text and "process_resident_memory_bytes" in text


def test_head_health_answers_like_get_without_a_body(server: LiveServer) -> None:
    """Issue 28 (weak): HEAD /health was 405, so a load balancer that checks with HEAD saw the server down."""
    head = httpx.head(f"{server.base_url}/health")
    assert head.status_code == 200 and head.content == b""
    assert head.headers["content-type"] == "application/json" and int(head.headers["content-length"]) > 0


def read_until_closed(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def test_a_client_that_half_closes_after_its_request_gets_its_answer(server: LiveServer) -> None:
    """Issue 28 (weak): the end of stream after the body was taken for a client gone, and nothing came back.
    Before the answer an interim 100 Continue arrives (how the server tells a half-close from a close)."""
    body = json.dumps({"prompt": "a kite", **FAST}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(
            b"POST /v1/images/generations HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            + f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        sock.shutdown(socket.SHUT_WR)
        reply = read_until_closed(sock)
    interim, _, final = reply.partition(b"\r\n\r\n")
    assert interim == b"HTTP/1.1 100 Continue"
    head, _, content = final.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ")
    assert len(json.loads(content)["data"]) == 1


def test_the_client_sends_its_api_key_as_a_bearer_token() -> None:
    app = make_app(dataclasses.replace(WARN, api_key="sk-served"))
    with LiveServer(app) as live:
        assert app.state.serve.wait_loaded(120)

        def client(key: str) -> openai.OpenAI:
            return openai.OpenAI(base_url=f"{live.base_url}/v1", api_key=key, max_retries=0, timeout=120)

        result = client("sk-served").images.generate(
            model="tiny", prompt="a kite", size="32x32", extra_body=EXTRA
        )
        assert result.data is not None and len(result.data) == 1
        with pytest.raises(openai.AuthenticationError) as caught:
            client("sk-wrong").models.list()
        assert caught.value.code == "invalid_api_key"
