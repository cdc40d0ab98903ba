"""The official `openai` client against a live server on loopback: generations, edits, seeds."""

from __future__ import annotations

import base64
import dataclasses
import io
from collections.abc import Iterator

import httpx
import openai
import pytest
from PIL import Image
from serve_testkit import WARN, LiveServer, make_app, png_bytes

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


def test_health_and_metrics_over_http(server: LiveServer) -> None:
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    text = httpx.get(f"{server.base_url}/metrics").text
    assert 'ditq_requests_total{endpoint="generations",status="200"}' in text
    assert "ditq_request_latency_seconds_bucket" in text and "process_resident_memory_bytes" in text


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
