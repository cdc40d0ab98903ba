"""Every error of the images API, through FastAPI's TestClient: status, envelope, field named."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import pytest
import torch
from serve_testkit import (
    FAST,
    WARN,
    GatedAdapter,
    client_for,
    make_app,
    nan_output,
    png_bytes,
    raise_once,
    tiny_adapter,
    transformer_hook,
)

from ditq.demo import DitqDemoPipeline
from ditq.runtime.adapter import PipelineAdapter
from ditq.serve import DoctorOutcome

GENERATIONS, EDITS = "/v1/images/generations", "/v1/images/edits"


def assert_error(response: Any, status: int, code: str, param: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code, error
    assert error["param"] == param, error
    assert error["message"]
    return error


@pytest.fixture(scope="module")
def client() -> Any:
    config = dataclasses.replace(WARN, max_pixels=64 * 64, max_body_bytes=256 * 1024)
    with client_for(make_app(config)) as client:
        yield client


# (JSON body, param named, code)
BAD_JSON = [
    ({"prompt": "a cat", "size": "big"}, "size", "invalid_value"),
    ({"prompt": "a cat", "size": "32x30"}, "size", "invalid_value"),  # not a multiple of 16
    ({"prompt": "a cat", "size": "128x128"}, "size", "invalid_value"),  # above max_pixels 64*64
    ({"prompt": "a cat", "size": "0x32"}, "size", "invalid_value"),
    ({"prompt": ""}, "prompt", "invalid_value"),
    ({"prompt": "   "}, "prompt", "invalid_value"),
    ({}, "prompt", "missing_parameter"),
    ({"prompt": "a cat", "n": 0}, "n", "invalid_value"),
    ({"prompt": "a cat", "n": 5}, "n", "invalid_value"),
    ({"prompt": "a cat", "num_inference_steps": 0}, "num_inference_steps", "invalid_value"),
    ({"prompt": "a cat", "num_inference_steps": 201}, "num_inference_steps", "invalid_value"),
    ({"prompt": "a cat", "guidance_scale": -1}, "guidance_scale", "invalid_value"),
    ({"prompt": "a cat", "true_cfg_scale": 51}, "true_cfg_scale", "invalid_value"),
    ({"prompt": "a cat", "seed": -1}, "seed", "invalid_value"),
    ({"prompt": "a cat", "seed": "abc"}, "seed", "invalid_value"),
    ({"prompt": "a cat", "response_format": "url"}, "response_format", "invalid_value"),
    ({"prompt": "a cat", "output_format": "gif"}, "output_format", "invalid_value"),
    (
        {"prompt": "a cat", "output_format": "jpeg", "background": "transparent"},
        "background",
        "invalid_value",
    ),
    ({"prompt": "a cat", "num_inference_step": 4}, "num_inference_step", "unknown_parameter"),
    ({"prompt": "a cat", "image": "x"}, "image", "unknown_parameter"),
    ({"prompt": "a cat", "negative_prompt": "x" * 32001}, "negative_prompt", "invalid_value"),
    ({"prompt": "a cat", "user": "u" * 257}, "user", "invalid_value"),
    ({"prompt": "a cat", "n": 10**4000}, "n", "invalid_value"),  # an int with no float
    ({"prompt": "a cat", "seed": 10**4000}, "seed", "invalid_value"),
    ({"prompt": "a cat", "size": "9" * 5000 + "x16"}, "size", "invalid_value"),
    # strict JSON types (issue 28, weak): each was read as something else and served
    ({"prompt": "a cat", "n": True}, "n", "invalid_value"),
    ({"prompt": "a cat", "n": "2"}, "n", "invalid_value"),
    ({"prompt": "a cat", "n": 2.0}, "n", "invalid_value"),
    ({"prompt": "a cat", "seed": 1e18}, "seed", "invalid_value"),
    ({"prompt": "a cat", "seed": "7"}, "seed", "invalid_value"),
    ({"prompt": "a cat", "seed": 2**63}, "seed", "invalid_value"),
    ({"prompt": "a cat", "num_inference_steps": False}, "num_inference_steps", "invalid_value"),
    ({"prompt": "a cat", "guidance_scale": True}, "guidance_scale", "invalid_value"),
    ({"prompt": "a cat", "return_stage_metrics": "yes"}, "return_stage_metrics", "invalid_value"),
    ({"prompt": "a cat", "return_stage_metrics": 1}, "return_stage_metrics", "invalid_value"),
    # OpenAI's fields the server ignores still have their values checked (issue 29)
    ({"prompt": "a cat", "quality": "ultra"}, "quality", "invalid_value"),
    ({"prompt": "a cat", "style": 3}, "style", "invalid_value"),
    ({"prompt": "a cat", "moderation": "none"}, "moderation", "invalid_value"),
    ({"prompt": "a cat", "safety_identifier": "s" * 257}, "safety_identifier", "invalid_value"),
    ({"prompt": "a cat", "output_compression": 101}, "output_compression", "invalid_value"),
    ({"prompt": "a cat", "partial_images": 4}, "partial_images", "invalid_value"),
    ({"prompt": "a cat", "stream": "yes"}, "stream", "invalid_value"),
    ({"prompt": "a cat", "input_fidelity": "high"}, "input_fidelity", "unknown_parameter"),  # edits only
    # ... and those asking for what is not made are refused (issue 29)
    ({"prompt": "a cat", "stream": True}, "stream", "unsupported_parameter"),
    ({"prompt": "a cat", "partial_images": 2}, "partial_images", "unsupported_parameter"),
    ({"prompt": "a cat", "frame_count": 4}, "frame_count", "unsupported_parameter"),
    ({"prompt": "a cat", "frame_duration_ms": 100}, "frame_duration_ms", "unsupported_parameter"),
    ({"prompt": "a cat", "svg": {"model": "x"}}, "svg", "unsupported_parameter"),
]


@pytest.mark.parametrize(("body", "param", "code"), BAD_JSON, ids=[f"{b}"[:60] for b, _, _ in BAD_JSON])
def test_invalid_field_is_400_naming_it(client: Any, body: dict[str, Any], param: str, code: str) -> None:
    error = assert_error(client.post(GENERATIONS, json=body), 400, code, param)
    assert param in error["message"]


def test_unknown_field_suggests_the_near_name(client: Any) -> None:
    body = {"prompt": "a cat", "num_inference_step": 4}
    error = assert_error(client.post(GENERATIONS, json=body), 400, "unknown_parameter", "num_inference_step")
    assert "did you mean 'num_inference_steps'" in error["message"]


def test_body_that_is_not_json_is_400(client: Any) -> None:
    response = client.post(GENERATIONS, content=b"{not json", headers={"content-type": "application/json"})
    assert_error(response, 400, "invalid_value", "body")


@pytest.mark.parametrize(
    "body",
    [
        b'{"prompt": "a cat", "n": ' + b"9" * 5000 + b"}",  # past Python's 4300-digit int conversion limit
        b"[" * 100_000 + b"]" * 100_000,  # past the interpreter's recursion limit
    ],
    ids=["5000-digit integer", "nested 100000 deep"],
)
def test_json_python_will_not_read_is_400_not_500(client: Any, body: bytes) -> None:
    """Issue 15, case 10: both were 500 with the exception's text."""
    response = client.post(GENERATIONS, content=body, headers={"content-type": "application/json"})
    assert_error(response, 400, "invalid_value", "body")


def test_a_5000_digit_form_field_is_400_naming_it(client: Any) -> None:
    files = [("image", ("a.png", png_bytes(), "image/png"))]
    assert_error(edit(client, files, n="9" * 5000), 400, "invalid_value", "n")


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", ""])
def test_json_without_application_json_is_415(client: Any, content_type: str) -> None:
    """A browser's cross-site form can send text/plain without asking; JSON must say it is JSON."""
    response = client.post(
        GENERATIONS, content=b'{"prompt": "a cat"}', headers={"content-type": content_type}
    )
    assert_error(response, 415, "unsupported_media_type", "body")


def test_edits_without_multipart_is_415(client: Any) -> None:
    assert_error(client.post(EDITS, json={"prompt": "a cat"}), 415, "unsupported_media_type", "body")


def test_a_multipart_body_cut_before_its_closing_boundary_is_400(client: Any) -> None:
    """Fields after the cut used to be dropped silently (here: n and seed would be lost)."""
    boundary = "cutcutcut"
    parts = [
        f'--{boundary}\r\ncontent-disposition: form-data; name="prompt"\r\n\r\nmake it blue\r\n'.encode(),
        f'--{boundary}\r\ncontent-disposition: form-data; name="image"; filename="a.png"\r\n'
        "content-type: image/png\r\n\r\n".encode()
        + png_bytes()
        + b"\r\n",
        f'--{boundary}\r\ncontent-disposition: form-data; name="n"\r\n\r\n2\r\n'.encode(),
        f"--{boundary}--\r\n".encode(),
    ]
    headers = {"content-type": f"multipart/form-data; boundary={boundary}"}
    whole = b"".join(parts)
    cut = whole[: whole.index(b'name="n"') + 8]
    assert_error(client.post(EDITS, content=cut, headers=headers), 400, "invalid_value", "body")
    complete = client.post(EDITS, content=whole, headers=headers)
    assert complete.status_code == 200 and len(complete.json()["data"]) == 2


def test_unknown_model_is_404(client: Any) -> None:
    assert_error(
        client.post(GENERATIONS, json={"prompt": "a", "model": "other"}), 404, "model_not_found", "model"
    )


def edit(client: Any, files: list[tuple[str, Any]], **fields: str) -> Any:
    data = {"prompt": "make it blue", "num_inference_steps": "1", "size": "32x32", **fields}
    return client.post(EDITS, data=data, files=files)


def test_too_many_images_is_400(client: Any) -> None:
    files = [("image[]", (f"{i}.png", png_bytes(), "image/png")) for i in range(5)]
    error = assert_error(edit(client, files), 400, "invalid_value", "image")
    assert "at most 4" in error["message"]


@pytest.mark.parametrize("count", [7, 8])
def test_more_files_than_the_form_takes_is_400_stating_the_real_limit(client: Any, count: int) -> None:
    """Issue 28 (weak): 7 images said "Maximum number of files is 6", though the limit is 4."""
    files = [("image[]", (f"{i}.png", png_bytes(), "image/png")) for i in range(count)]
    error = assert_error(edit(client, files), 400, "invalid_value", "image")
    assert error["message"].endswith("the served pipeline takes at most 4")


def test_unknown_path_uses_the_envelope(client: Any) -> None:
    response = client.get("/v1/images/variations")
    assert response.status_code == 404 and response.json()["error"]["message"] == "Not Found"


def test_zero_byte_image_is_400(client: Any) -> None:
    files = [("image", ("a.png", png_bytes(), "image/png")), ("image", ("empty.png", b"", "image/png"))]
    error = assert_error(edit(client, files), 400, "invalid_value", "image")
    assert "empty.png" in error["message"] and "0 bytes" in error["message"]


def test_undecodable_image_is_400(client: Any) -> None:
    files = [("image[]", ("notes.png", b"this is not a png", "image/png"))]
    error = assert_error(edit(client, files), 400, "invalid_value", "image")
    assert "notes.png" in error["message"]


def test_edit_without_image_is_400(client: Any) -> None:
    assert_error(
        client.post(EDITS, data={"prompt": "x"}, files=[("unused", ("a.txt", b"x"))]),
        400,
        "invalid_value",
        "unused",
    )


@pytest.mark.parametrize("value", ["yes", "1", "on"])
def test_a_form_boolean_is_true_or_false(client: Any, value: str) -> None:
    """Issue 28 (weak): return_stage_metrics "yes" was read as true (pydantic's lax words)."""
    files = [("image", ("a.png", png_bytes(), "image/png"))]
    error = edit(client, files, return_stage_metrics=value)
    assert_error(error, 400, "invalid_value", "return_stage_metrics")


@pytest.mark.parametrize("field", ["mask", "mask[]", "markup"])
def test_mask_and_markup_are_refused_by_name(client: Any, field: str) -> None:
    files = [("image", ("a.png", png_bytes(), "image/png")), (field, ("m.png", png_bytes(), "image/png"))]
    assert_error(edit(client, files), 400, "unsupported_parameter", field.removesuffix("[]"))


# (form fields, param named, code): the edits form's side of issue 29
BAD_FORM = [
    ({"stream": "true"}, "stream", "unsupported_parameter"),
    ({"partial_images": "1"}, "partial_images", "unsupported_parameter"),
    ({"svg[model]": "x"}, "svg", "unsupported_parameter"),  # the client's form of a nested object
    ({"style": "vivid"}, "style", "unknown_parameter"),  # generations only
    ({"quality": "best"}, "quality", "invalid_value"),
    ({"input_fidelity": "exact"}, "input_fidelity", "invalid_value"),
]


@pytest.mark.parametrize(("fields", "param", "code"), BAD_FORM, ids=[f"{f}" for f, _, _ in BAD_FORM])
def test_invalid_or_refused_form_field_is_400_naming_it(
    client: Any, fields: dict[str, str], param: str, code: str
) -> None:
    files = [("image", ("a.png", png_bytes(), "image/png"))]
    assert_error(edit(client, files, **fields), 400, code, param)


def test_form_field_out_of_range_is_400(client: Any) -> None:
    files = [("image", ("a.png", png_bytes(), "image/png"))]
    assert_error(edit(client, files, seed="-3"), 400, "invalid_value", "seed")


def test_body_over_limit_is_413(client: Any) -> None:
    files = [("image", ("big.png", b"\0" * (300 * 1024), "image/png"))]
    response = edit(client, files)
    assert_error(response, 413, "body_too_large")
    assert 'ditq_requests_total{endpoint="edits",status="413"}' in client.get("/metrics").text


class _NoNegativePromptPipeline(DitqDemoPipeline):
    """The demo pipeline with a narrower __call__: no negative_prompt, no true_cfg_scale."""

    def __call__(  # type: ignore[override]
        self,
        prompt: Any,
        image: Any = None,
        height: Any = None,
        width: Any = None,
        num_inference_steps: Any = None,
        guidance_scale: Any = None,
        generator: Any = None,
        num_images_per_prompt: int = 1,
        output_type: str = "pil",
    ) -> Any:
        return super().__call__(
            prompt=prompt,
            image=image,
            height=height,
            width=width,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            generator=generator,
            num_images_per_prompt=num_images_per_prompt,
            output_type=output_type,
        )


def test_extension_the_pipeline_does_not_take_is_400_naming_it() -> None:
    real = tiny_adapter().pipeline
    narrow = _NoNegativePromptPipeline(
        transformer=real.transformer, text_encoder=real.text_encoder, scheduler=real.scheduler
    )
    with client_for(make_app(load=lambda: PipelineAdapter(narrow))) as client:
        body = {"prompt": "a cat", "negative_prompt": "blur", **FAST}
        error = assert_error(
            client.post(GENERATIONS, json=body), 400, "unsupported_parameter", "negative_prompt"
        )
        assert "_NoNegativePromptPipeline" in error["message"]
        assert client.post(GENERATIONS, json={"prompt": "a cat", **FAST}).status_code == 200


def test_queue_full_is_429_and_only_beyond_the_bound() -> None:
    gated = GatedAdapter(tiny_adapter())
    config = dataclasses.replace(WARN, max_queue=2)
    with client_for(make_app(config, load=lambda: gated)) as client:
        results: list[int] = []

        def post(prompt: str) -> None:
            results.append(client.post(GENERATIONS, json={"prompt": prompt, **FAST}).status_code)

        threads = [threading.Thread(target=post, args=("running",))]
        threads[0].start()
        assert gated.entered.acquire(timeout=30)  # the worker holds the first request
        worker = client.app.state.serve.worker
        for depth, prompt in enumerate(("queued 1", "queued 2"), start=1):
            threads.append(threading.Thread(target=post, args=(prompt,)))
            threads[-1].start()
            while worker.queue_depth < depth:  # one at a time, so the arrival order is known
                threading.Event().wait(0.02)
        assert_error(client.post(GENERATIONS, json={"prompt": "one too many", **FAST}), 429, "queue_full")
        gated.release.set()
        for thread in threads:
            thread.join(60)
        assert results == [200, 200, 200]
        assert gated.prompts == ["running", "queued 1", "queued 2"]  # first in, first out


def test_request_timeout_is_504_and_the_queued_request_never_runs() -> None:
    gated = GatedAdapter(tiny_adapter())
    config = dataclasses.replace(WARN, request_timeout_s=0.5)
    with client_for(make_app(config, load=lambda: gated)) as client:
        first = threading.Thread(
            target=client.post, args=(GENERATIONS,), kwargs={"json": {"prompt": "slow", **FAST}}
        )
        first.start()
        assert gated.entered.acquire(timeout=30)
        assert_error(client.post(GENERATIONS, json={"prompt": "late", **FAST}), 504, "timeout")
        gated.release.set()
        first.join(60)
        assert gated.prompts == ["slow"]
        assert "ditq_dropped_requests_total 1" in client.get("/metrics").text


def test_loading_is_503_and_health_turns_200_when_loaded() -> None:
    loaded = threading.Event()

    def slow_load() -> PipelineAdapter:
        loaded.wait(60)
        return tiny_adapter()

    app = make_app(load=slow_load)
    with client_for(app, wait=False) as client:
        assert client.get("/health").status_code == 503
        assert_error(client.post(GENERATIONS, json={"prompt": "a"}), 503, "model_loading")
        loaded.set()
        assert app.state.serve.wait_loaded(60)
        health = client.get("/health")
        assert health.status_code == 200 and health.json()["doctor"]["status"] == "passed"


def test_failed_doctor_keeps_health_503_and_refuses_requests() -> None:
    app = make_app(doctor=lambda _adapter: DoctorOutcome("failed", "path triton-w8a8 returned NaN"))
    with client_for(app) as client:
        health = client.get("/health")
        assert health.status_code == 503 and "triton-w8a8" in health.json()["error"]
        assert_error(client.post(GENERATIONS, json={"prompt": "a"}), 503, "model_unavailable")


def test_draining_is_503() -> None:
    app = make_app()
    with client_for(app) as client:
        app.state.serve.begin_drain()
        assert_error(client.post(GENERATIONS, json={"prompt": "a", **FAST}), 503, "draining")
        assert client.get("/health").status_code == 503


def test_generation_failure_is_500_without_its_text_and_the_next_request_is_served(
    client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    fault = RuntimeError("gs -dSAFER /tmp/tmpab12cd/input.eps failed")  # what a leak looked like (issue 15)
    with transformer_hook(tiny_adapter(), raise_once(fault)):
        error = assert_error(client.post(GENERATIONS, json={"prompt": "a", **FAST}), 500, "generation_failed")
        assert "/tmp" not in error["message"] and "gs " not in error["message"]
        error_id = error["message"].rsplit(" ", 1)[-1]
        logged = [r for r in caplog.records if error_id in r.getMessage()]  # the log has it, under the id
        assert logged and "input.eps" in str(logged[0].exc_info[1])
        assert client.post(GENERATIONS, json={"prompt": "a", **FAST}).status_code == 200


def test_out_of_memory_is_503_counted_and_the_next_request_is_served(client: Any) -> None:
    with transformer_hook(tiny_adapter(), raise_once(torch.OutOfMemoryError("CUDA out of memory"))):
        assert_error(client.post(GENERATIONS, json={"prompt": "a", **FAST}), 503, "out_of_memory")
        assert client.post(GENERATIONS, json={"prompt": "a", **FAST}).status_code == 200
    assert "ditq_out_of_memory_total 1" in client.get("/metrics").text


def test_non_finite_output_is_500_by_default() -> None:
    config = dataclasses.replace(WARN, on_collapse="error")
    with client_for(make_app(config)) as client, transformer_hook(tiny_adapter(), nan_output):
        error = assert_error(client.post(GENERATIONS, json={"prompt": "a", **FAST}), 500, "non_finite_output")
        assert "flat" in error["message"]
        assert "ditq_collapsed_outputs_total 1" in client.get("/metrics").text


def test_non_finite_output_can_be_a_warning_instead(client: Any) -> None:
    with transformer_hook(tiny_adapter(), nan_output):
        response = client.post(GENERATIONS, json={"prompt": "a", **FAST})
    assert response.status_code == 200
    assert any(w.startswith("non_finite_output") and "flat" in w for w in response.json()["warnings"])
