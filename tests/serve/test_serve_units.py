"""Settings, the --max-memory size parser, the Prometheus exposition and image encoding."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from ditq.devices import parse_memory_size
from ditq.errors import InputError
from ditq.judge.gate import load_rules
from ditq.runtime.images import collapse_reasons, encode_image
from ditq.runtime.memory_cap import apply_memory_cap
from ditq.serve.config import ServeConfig
from ditq.serve.metrics import ServerMetrics, endpoint_label


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("24GiB", 24 * 1024**3),
        ("24GB", 24 * 10**9),
        ("20000MiB", 20000 * 1024**2),
        ("1.5g", 1_500_000_000),
        ("4096", 4096),
    ],
)
def test_memory_sizes(text: str, expected: int) -> None:
    assert parse_memory_size(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "24 parsecs", "0GiB", "-1GB"])
def test_bad_memory_sizes_name_the_option(text: str) -> None:
    with pytest.raises(InputError, match="--max-memory"):
        parse_memory_size(text)


def test_settings_are_validated() -> None:
    with pytest.raises(InputError, match="max_queue"):
        ServeConfig(max_queue=0)
    with pytest.raises(InputError, match="on_collapse"):
        ServeConfig(on_collapse="ignore")  # type: ignore[arg-type]
    with pytest.raises(InputError, match="bomb limit"):
        ServeConfig(max_image_pixels=Image.MAX_IMAGE_PIXELS)  # the 9400x9400 PNGs lay just below it
    with pytest.raises(InputError, match="api_key"):
        ServeConfig(api_key=" ")


def test_latency_histogram_is_cumulative_with_sum_and_count() -> None:
    metrics = ServerMetrics()
    for seconds in (0.07, 0.3, 0.3, 700.0):
        metrics.observe_request("generations", 200, seconds)
    metrics.observe_request("generations", 429, 0.001)
    text = metrics.render()
    assert 'ditq_requests_total{endpoint="generations",status="200"} 4' in text
    assert 'ditq_requests_total{endpoint="generations",status="429"} 1' in text
    assert 'ditq_request_latency_seconds_bucket{endpoint="generations",le="0.05"} 1' in text
    assert 'ditq_request_latency_seconds_bucket{endpoint="generations",le="0.1"} 2' in text
    assert 'ditq_request_latency_seconds_bucket{endpoint="generations",le="0.5"} 4' in text
    assert 'ditq_request_latency_seconds_bucket{endpoint="generations",le="600"} 4' in text
    assert 'ditq_request_latency_seconds_bucket{endpoint="generations",le="+Inf"} 5' in text
    assert 'ditq_request_latency_seconds_count{endpoint="generations"} 5' in text
    assert 'ditq_request_latency_seconds_sum{endpoint="generations"} 700.671000' in text


def test_a_forged_path_cannot_reach_the_exposition() -> None:
    """Issue 15, case 5: a rejected request's decoded path was written unescaped as a label."""
    forged = '/x"} 1\nditq_out_of_memory_total 99999\n#'
    metrics = ServerMetrics()
    for index in range(2000):  # one label per path used to grow /metrics without bound
        metrics.observe_request(endpoint_label(f"{forged}{index}"), 413, 0.01)
    metrics.observe_request(endpoint_label("/v1/images/edits/"), 413, 0.01)
    text = metrics.render()
    assert "99999" not in text and 'x"' not in text
    assert 'ditq_requests_total{endpoint="other",status="413"} 2000' in text
    assert 'ditq_requests_total{endpoint="edits",status="413"} 1' in text
    assert len(text) < 10_000
    with pytest.raises(ValueError, match="fixed set"):
        metrics.observe_request(forged, 413, 0.01)


def test_peak_accelerator_memory_is_the_largest_seen() -> None:
    metrics = ServerMetrics()
    assert "ditq_peak_accelerator_memory_bytes" not in metrics.render()  # unknown on the CPU
    for peak in (100, 300, None, 200):
        metrics.observe_peak_memory(peak)
    assert "ditq_peak_accelerator_memory_bytes 300" in metrics.render()


def _noise(mode: str = "RGBA") -> Image.Image:
    pixels = bytes((i * 37 + (i // 7) * 11) % 256 for i in range(32 * 32 * 4))
    image = Image.frombytes("RGBA", (32, 32), pixels)
    image.putalpha(255)
    return image.convert(mode)


def _half_transparent() -> Image.Image:
    image = _noise()
    image.putalpha(120)
    return image


def test_collapse_signatures() -> None:
    rules = load_rules()
    assert collapse_reasons(_noise(), rules) == []
    assert any(r.startswith("flat") for r in collapse_reasons(Image.new("RGB", (32, 32)), rules))
    assert any(r.startswith("transparent") for r in collapse_reasons(Image.new("RGBA", (32, 32)), rules))
    assert any(r.startswith("transparent") for r in collapse_reasons(_half_transparent(), rules))


@pytest.mark.parametrize(
    ("output_format", "background", "mode"),
    [
        ("png", "auto", "RGBA"),
        ("png", "opaque", "RGB"),
        ("webp", "transparent", "RGBA"),
        ("jpeg", "auto", "RGB"),
    ],
)
def test_encoding_keeps_alpha_only_where_asked_and_possible(
    output_format: str, background: str, mode: str
) -> None:
    data = encode_image(_half_transparent(), output_format, background)
    decoded = Image.open(io.BytesIO(data))
    assert decoded.format == output_format.upper() and decoded.mode == mode and decoded.size == (32, 32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_max_memory_caps_cuda_allocations(device: str) -> None:
    torch.cuda.empty_cache()
    try:
        cap = apply_memory_cap("2GiB", device)
        assert cap is not None and cap.device == "cuda:0" and cap.budget_bytes == 2 * 1024**3
        # the CUDA context is measured and taken off the budget: the allocator gets the rest
        assert 0 < cap.outside_allocator_bytes < 2 * 1024**3
        assert cap.allocator_bytes == cap.budget_bytes - cap.outside_allocator_bytes
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(2 * 1024**3, dtype=torch.uint8, device=device)
        kept = torch.empty(256 * 1024**2, dtype=torch.uint8, device=device)  # under the cap: fine
        del kept
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


def test_a_refusal_found_while_generating_names_the_field_the_error_carries() -> None:
    from ditq.serve.app import _input_error

    named = _input_error(InputError("the second reference: cannot be decoded", field="image"))
    assert (named.status, named.param, named.code) == (400, "image", "invalid_value")
    assert named.message == "the second reference: cannot be decoded"
    assert _input_error(InputError("width: a prefix is not a field")).param is None


def test_stage_metrics_from_one_generation_in_milliseconds() -> None:
    from ditq.runtime.adapter import GenerationResult
    from ditq.runtime.stage_metrics import StageMetrics

    result = GenerationResult(
        images=[Image.new("RGB", (32, 48))],
        timings={
            "text_encoding": 0.5,
            "denoising": 2.0,
            "decoding": 0.25,
            "postprocess": 0.125,
            "total": 3.0,
        },
        step_times=[1.0, 1.0],
        peak_memory_bytes=3 * 1024**2,
    )
    served = StageMetrics.from_result(
        result, queue_wait_s=0.5, encode_s=0.125, steps_asked=8, every_step=False
    )
    assert served.model_dump() == {
        "queue_wait_ms": 500.0,
        "text_encoding_ms": 500.0,
        "denoising_ms": 2000.0,
        "denoise_step_latency_ms": 1000.0,
        "decoding_ms": 250.0,
        "postprocess_time_ms": 250.0,
        "generation_ms": 3000.0,
        "peak_memory_mb": 3.0,
        "num_inference_steps": 2,
        "image_pixels": 32 * 48,
        "denoise_step_latencies_ms": None,
        "stage_peak_memory_mb": None,  # CUDA's, and only with return_stage_metrics
        "memory_at_start_mb": None,
        "predicted_peak_memory_mb": None,  # no cost model here
        "rank_peak_memory_mb": None,  # one device
        "skipped_steps": None,  # no step cache (--cache)
    }
    no_steps = GenerationResult(result.images, result.timings, [], None)
    in_process = StageMetrics.from_result(
        no_steps, queue_wait_s=0.0, encode_s=0.0, steps_asked=8, every_step=True
    )
    assert (in_process.num_inference_steps, in_process.denoise_step_latencies_ms) == (8, [])
    assert in_process.peak_memory_mb is None and in_process.denoise_step_latency_ms == 0.0


@pytest.mark.parametrize("revised", [None, 'a "quoted" prompt, ünïcode and a \\ backslash'])
def test_the_answer_body_is_the_json_of_the_response(revised: str | None) -> None:
    import base64
    import json

    from ditq.serve.schemas import ImageData, ImageResponse, ImageUsage, StageMetrics

    images = [base64.b64encode(bytes(range(256)) * 3 + bytes(n)).decode("ascii") for n in range(3)]
    response = ImageResponse(
        created=1796354797,
        data=[ImageData(b64_json=image, revised_prompt=revised) for image in images],
        output_format="png",
        size="32x48",
        background="auto",
        usage=ImageUsage(input_images=2, output_images=3, output_pixels=3 * 32 * 48),
        metrics=StageMetrics(
            queue_wait_ms=0.5,
            text_encoding_ms=1.0,
            denoising_ms=2.0,
            denoise_step_latency_ms=1.0,
            decoding_ms=0.25,
            postprocess_time_ms=0.125,
            generation_ms=3.0,
            peak_memory_mb=None,
            num_inference_steps=2,
            image_pixels=32 * 48,
        ),
        warnings=['non_finite_output: image 1 of 3: "flat" \u2013 std 0.0'],
    )
    body = response.json_bytes()
    assert json.loads(body) == response.model_dump(exclude_none=True)
    assert body.decode("utf-8").isprintable() and "\\u2013" not in body.decode("utf-8")  # UTF-8, not escapes
