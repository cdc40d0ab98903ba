"""``ditq serve --parallel`` over NCCL, one CUDA device per rank, live on loopback (``benchmarks/h200_parallel.sh``
runs them): context parallelism on the demo model's fp8 artifact draws what one device draws, within bfloat16's
rounding; a killed rank answers 503 ``degraded`` within 10 s; tensor parallelism serves the source model and refuses
the quantized one in one line."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from serve_testkit import serve_process

import ditq
from ditq.demo import default_model_dir
from ditq.errors import EXIT_USAGE
from ditq.metrics import load_png_array, psnr
from ditq.pipeline.open import load_pipeline
from ditq.runtime.adapter import GenerationRequest, PipelineAdapter
from ditq.sweep.health import wait_healthy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

FIELDS: dict[str, Any] = {"prompt": "a red circle on a white background", "size": "64x64", "seed": 3}
STEPS = 8
MIN_PSNR_DB = 40.0  # one device against two in bfloat16: GEMMs of other shapes round otherwise, no more


@pytest.fixture(scope="module")
def fp8_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("parallel") / "fp8"
    ditq.quantize(default_model_dir(), out, "fp8")
    return out


def _server(
    tmp_path: Path, model: Path, *args: str
) -> AbstractContextManager[tuple[subprocess.Popen[str], str, Path]]:
    return serve_process(tmp_path, str(model), "--device", "cuda", *args)


def _one_device(model: Path) -> np.ndarray:
    adapter = PipelineAdapter(load_pipeline(model, device="cuda:0"))
    request = GenerationRequest(
        prompt=FIELDS["prompt"], width=64, height=64, seed=3, num_inference_steps=STEPS
    )
    return np.asarray(adapter(request).images[0])


def _served(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    return load_png_array(base64.b64decode(response.json()["data"][0]["b64_json"]))[0]


def test_context_parallel_over_nccl_draws_what_one_device_draws_and_a_killed_rank_gives_503(
    fp8_artifact: Path, tmp_path: Path
) -> None:
    expected = _one_device(fp8_artifact)
    with _server(tmp_path, fp8_artifact, "--parallel", "cp=2", "--on-collapse", "warn") as (
        process,
        url,
        log,
    ):
        assert wait_healthy(url, 600, process) is None, log.read_text()[-2000:]
        health = httpx.get(f"{url}/health").json()
        assert (
            health["parallel"]["devices"] == ["cuda:0", "cuda:1"] and health["parallel"]["backend"] == "nccl"
        )
        served = httpx.post(
            f"{url}/v1/images/generations", json={**FIELDS, "num_inference_steps": STEPS}, timeout=120
        )
        assert psnr(_served(served), expected) >= MIN_PSNR_DB
        peaks = served.json()["metrics"]["rank_peak_memory_mb"]
        assert len(peaks) == 2 and all(peak > 0 for peak in peaks)
        answers: list[int] = []
        long = {**FIELDS, "size": "1024x1024", "num_inference_steps": 200}

        def long_request() -> None:
            answers.append(httpx.post(f"{url}/v1/images/generations", json=long, timeout=120).status_code)

        thread = threading.Thread(target=long_request)
        thread.start()
        deadline = time.monotonic() + 60
        while httpx.get(f"{url}/health").json()["running"] is None:
            assert time.monotonic() < deadline and thread.is_alive(), answers
            time.sleep(0.05)
        killed = time.monotonic()
        os.kill(health["parallel"]["ranks"][1]["pid"], signal.SIGKILL)
        thread.join(10)
        after = httpx.get(f"{url}/health")
        assert answers == [503] and time.monotonic() - killed < 10
        assert after.status_code == 503 and after.json()["status"] == "degraded"


def test_tensor_parallel_serves_the_source_model_and_refuses_a_quantized_one(
    fp8_artifact: Path, tmp_path: Path
) -> None:
    expected = _one_device(default_model_dir())
    with _server(tmp_path, default_model_dir(), "--parallel", "tp=2", "--on-collapse", "warn") as (
        process,
        url,
        log,
    ):
        assert wait_healthy(url, 600, process) is None, log.read_text()[-2000:]
        served = httpx.post(
            f"{url}/v1/images/generations", json={**FIELDS, "num_inference_steps": STEPS}, timeout=120
        )
        assert psnr(_served(served), expected) >= MIN_PSNR_DB
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "ditq.cli",
            "serve",
            str(fp8_artifact),
            "--device",
            "cuda",
            "--parallel",
            "tp=2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == EXIT_USAGE
    assert refused.stderr.strip().splitlines()[-1].endswith("serve it with cp=2")
