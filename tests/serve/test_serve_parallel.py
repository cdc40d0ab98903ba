"""``--parallel cp=2`` on the CPU: two ranks over gloo, this process rank 0 and one spawned follower, on the tiny demo
pipeline (a miniature Qwen-Image-2.1 with the prefix KV cache). Context parallelism draws what one process draws, for
the source model and for its w8a8 artifact; ranks that stop agree on the step; a live server that loses its follower
mid-request answers 503 ``degraded`` within seconds and never hangs. Each test starts one follower (about 5 s of
imports on a CPU), loading while this process draws the single-process image."""

from __future__ import annotations

import base64
import io
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image
from serve_testkit import LiveServer

from ditq.pipeline.open import load_pipeline
from ditq.runtime.adapter import GenerationCancelled, GenerationRequest, PipelineAdapter
from ditq.runtime.options import LoadOptions
from ditq.runtime.parallel import ParallelSpec
from ditq.serve import ServeConfig
from ditq.serve.ranks import RankGroup, RankSettings
from ditq.serve.server import serving_app

pytestmark = pytest.mark.slow

CP2 = ParallelSpec("cp", 2)
# Two references, guidance on (its negative prompt pads the prompt batch: the decode's padding mask is exercised),
# three steps (one prefill that fills the prefix KV cache, two decodes that read it).
FIELDS: dict[str, Any] = {"prompt": "a red circle", "size": "32x32", "num_inference_steps": 3, "seed": 7}


def _references() -> list[Image.Image]:
    return [Image.new("RGB", (32, 32), colour) for colour in ((220, 30, 30), (30, 30, 220))]


def _request(**changes: Any) -> GenerationRequest:
    fields = {"prompt": FIELDS["prompt"], "width": 32, "height": 32, "num_inference_steps": 3, "seed": 7}
    return GenerationRequest(**{**fields, "images": _references(), **changes})


def _pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image, dtype=np.int16)


def _one_process(model_dir: Path) -> np.ndarray:
    return _pixels(PipelineAdapter(load_pipeline(model_dir, device="cpu"))(_request()).images[0])


def test_two_ranks_draw_what_one_process_draws_and_stop_at_the_same_step(
    demo_artifacts: dict[str, Path],
) -> None:
    group = RankGroup(
        RankSettings(
            demo_artifacts["source"], CP2, ("cpu", "cpu"), LoadOptions(device="cpu", dtype="float32")
        )
    )
    group.launch()
    try:
        expected = _one_process(demo_artifacts["source"])  # while the follower loads
        adapter = group.join()
        tokens: list[tuple[int, int]] = []  # (this rank's, the whole sequence's) at the output projection
        adapter.pipeline.transformer.proj_out.register_forward_hook(
            lambda _module, args, output: tokens.append((args[0].shape[1], output.shape[1]))
        )
        drawn = _pixels(adapter(_request()).images[0])
        steps: list[int] = []

        def stop_after_one() -> str | None:
            steps.append(1)
            return "timeout" if len(steps) == 1 else None

        with pytest.raises(GenerationCancelled) as cancelled:
            adapter(_request(num_inference_steps=5, should_stop=stop_after_one))
        assert cancelled.value.steps_done == 1
        again = _pixels(adapter(_request()).images[0])  # the ranks are in step after the stop
        facts = group.to_json()
    finally:
        group.close()
    # each rank held a half of the sequence
    assert tokens and all(whole // 2 <= mine < whole for mine, whole in tokens), tokens
    assert np.abs(drawn - expected).max() <= 1, "context parallel drew another image than one process"
    assert np.array_equal(again, drawn)
    assert facts["lost"] is None
    assert all(rank["peak_memory_bytes"] > 0 for rank in facts["ranks"]) and len(facts["ranks"]) == 2


def _image(response: httpx.Response) -> np.ndarray:
    return _pixels(Image.open(io.BytesIO(base64.b64decode(response.json()["data"][0]["b64_json"]))))


def _wait_ready(base_url: str, deadline_s: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + deadline_s
    while (health := httpx.get(f"{base_url}/health")).json()["status"] != "ready":
        assert health.json()["status"] == "loading" and time.monotonic() < deadline, health.text
        time.sleep(0.1)
    body: dict[str, Any] = health.json()
    return body


def test_a_parallel_server_serves_w8a8_then_answers_503_once_a_rank_dies_mid_request(
    demo_artifacts: dict[str, Path],
) -> None:
    config = ServeConfig(served_model_name="tiny", on_collapse="warn", max_pixels=32 * 32)
    app, ranks = serving_app(demo_artifacts["w8a8"], config, LoadOptions(device="cpu"), parallel=CP2)
    assert ranks is not None
    ranks.launch()
    try:
        expected = _one_process(demo_artifacts["w8a8"])
        with LiveServer(app) as server, httpx.Client(base_url=server.base_url, timeout=60) as client:
            health = _wait_ready(server.base_url)
            files = []
            for index, picture in enumerate(_references()):
                buffer = io.BytesIO()
                picture.save(buffer, format="PNG")
                files.append(("image[]", (f"ref{index}.png", buffer.getvalue(), "image/png")))
            served = client.post("/v1/images/edits", data={**FIELDS, "model": "tiny"}, files=files)
            assert served.status_code == 200, served.text
            assert np.abs(_image(served) - expected).max() <= 1
            assert served.json()["metrics"]["rank_peak_memory_mb"] == [None, None]  # per rank; CUDA only
            parallel = health["parallel"]
            assert (parallel["mode"], parallel["degree"], parallel["backend"]) == ("cp", 2, "gloo")
            assert parallel["devices"] == ["cpu", "cpu"] and health["quantized"]["transformer"]["w8a8"] > 0

            answers: list[tuple[int, str, float]] = []

            def long_request() -> None:
                started = time.monotonic()
                long = client.post("/v1/images/generations", json={**FIELDS, "num_inference_steps": 200})
                answers.append((long.status_code, long.json()["error"]["code"], time.monotonic() - started))

            thread = threading.Thread(target=long_request)
            thread.start()
            deadline = time.monotonic() + 30
            while client.get("/health").json()["running"] is None:
                assert time.monotonic() < deadline and thread.is_alive(), answers
                time.sleep(0.02)
            killed = time.monotonic()
            os.kill(parallel["ranks"][1]["pid"], signal.SIGKILL)
            thread.join(10)
            assert not thread.is_alive(), "the request hung after its rank died"
            after = client.get("/health")
            assert time.monotonic() - killed < 10
            assert answers and answers[0][:2] == (503, "degraded")
            assert after.status_code == 503 and after.json()["status"] == "degraded"
            assert "rank 1" in after.json()["error"] and "killed by signal 9" in after.json()["error"]
            refused = client.post("/v1/images/generations", json=FIELDS)
            assert (refused.status_code, refused.json()["error"]["code"]) == (503, "degraded")
    finally:
        ranks.close()
