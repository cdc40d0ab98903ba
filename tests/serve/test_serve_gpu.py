"""`ditq serve --max-memory` on a CUDA device, live on loopback: a request past the budget is refused (413
``over_memory_budget`` when the calibrated lower bound already passes it, else 503 ``out_of_memory`` once it runs out)
and the server serves the next one; a model past the budget stops start-up with exit code 3; the cost model
measures the allocator on CUDA. `ditq serve --lora` on CUDA: each request's adapters draw what ditq's Python pipeline
draws with them."""

from __future__ import annotations

import base64
import gc
import io
import subprocess
from contextlib import AbstractContextManager
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from lora_kit import drawn_with, load_both_adapters
from PIL import Image
from serve_testkit import serve_process

import ditq
from ditq.demo import default_model_dir
from ditq.errors import EXIT_OUT_OF_MEMORY
from ditq.metrics import psnr
from ditq.pipeline.open import open_pipeline
from ditq.runtime.adapter import GenerationRequest
from ditq.runtime.options import LoadOptions
from ditq.serve.cost import RequestCost, calibrate
from ditq.sweep.health import wait_healthy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MIB = 1024**2
SMALL = {"prompt": "a red circle on a white background", "size": "64x64", "num_inference_steps": 2, "seed": 0}
# Four 2048x2048 images in one request: far more activation memory than SMALL (measured below, not assumed)
BIG = {**SMALL, "size": "2048x2048", "n": 4, "num_inference_steps": 1}


def _allocator_peaks() -> tuple[int, int]:
    """The allocator's peak for SMALL and BIG on the demo model, in this process, without a budget."""
    adapter = open_pipeline(default_model_dir(), LoadOptions(device="cuda", dtype="bfloat16"))
    peaks = []
    for fields in (SMALL, BIG):
        width, height = (int(v) for v in str(fields["size"]).split("x"))
        request = GenerationRequest(
            prompt=str(fields["prompt"]),
            width=width,
            height=height,
            num_inference_steps=int(fields["num_inference_steps"]),
            seed=0,
            num_images=int(fields.get("n", 1)),
        )
        peak = adapter(request).peak_memory_bytes
        assert peak is not None
        peaks.append(peak)
    del adapter
    gc.collect()
    torch.cuda.empty_cache()
    return peaks[0], peaks[1]


def _server(tmp_path: Path, *args: str) -> AbstractContextManager[tuple[subprocess.Popen[str], str, Path]]:
    return serve_process(tmp_path, "--device", "cuda:0", *args)


def _process_mib(pid: int) -> float | None:
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    used = [p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle) if p.pid == pid]
    return used[0] / MIB if used and used[0] is not None else None


def test_a_request_past_the_budget_is_503_and_the_next_one_is_served(tmp_path: Path) -> None:
    small, big = _allocator_peaks()
    assert big - small > 2 * 1024**3, f"BIG must need clearly more memory than SMALL ({small=}, {big=})"
    budget_mib = (small + big) // 2 // MIB + 512  # 512 MiB for the CUDA context, measured by the server
    with _server(tmp_path, "--max-memory", f"{budget_mib}MiB", "--on-collapse", "warn") as (
        process,
        base,
        log,
    ):
        assert wait_healthy(base, 300, process) is None, log.read_text()[-3000:]
        cap = httpx.get(f"{base}/health").json()["max_memory"]
        assert cap["budget_bytes"] == budget_mib * MIB and cap["device"] == "cuda:0"
        assert small < cap["allocator_bytes"] < big, cap  # the budget sits between the two requests

        with httpx.Client(base_url=base, timeout=600) as client:
            assert client.post("/v1/images/generations", json=SMALL).status_code == 200
            over = client.post("/v1/images/generations", json=BIG)
            code = over.json()["error"]["code"]
            assert (over.status_code, code) in ((503, "out_of_memory"), (413, "over_memory_budget")), (
                over.text
            )
            assert client.get("/health").json()["status"] == "ready"
            after = client.post("/v1/images/generations", json=SMALL)
            assert after.status_code == 200, after.text
            ran_out = "ditq_out_of_memory_total 1" in client.get("/metrics").text
            assert ran_out == (code == "out_of_memory")  # a 413 never ran
        used = _process_mib(process.pid)
        if used is not None:  # the driver's count for the whole process stays inside the budget
            assert used <= budget_mib, f"{used:.0f} MiB used under a {budget_mib} MiB budget"


def test_a_model_past_the_budget_stops_start_up_with_exit_code_3(tmp_path: Path) -> None:
    with _server(tmp_path, "--max-memory", "16GiB") as (process, base, log):
        assert wait_healthy(base, 300, process) is None, log.read_text()[-3000:]
        outside = httpx.get(f"{base}/health").json()["max_memory"]["outside_allocator_bytes"]
    # Room for the CUDA context and 8 MiB: the demo model's 12 MB of weights cannot load.
    with _server(tmp_path, "--max-memory", f"{outside // MIB + 8}MiB") as (process, _, log):
        assert process.wait(300) == EXIT_OUT_OF_MEMORY, log.read_text()[-3000:]
    assert "ran out of accelerator memory" in log.read_text()


def test_the_cost_model_measures_the_cuda_allocator_and_refuses_what_cannot_fit() -> None:
    adapter = open_pipeline(default_model_dir(), LoadOptions(device="cuda", dtype="bfloat16"))
    try:
        device = torch.device("cuda", torch.cuda.current_device())
        measured = calibrate(adapter, device, 2048 * 2048, 600, allocator_budget_bytes=None)
        largest = measured.measurements[0]  # the default size with the most references
        assert largest.references == adapter.max_reference_images
        assert largest.stage_memory_bytes is not None and {"first_step", "later_steps"} <= set(
            largest.stage_memory_bytes
        )
        assert largest.memory_bytes == max(largest.stage_memory_bytes.values()) > 0
        assert measured.memory_budget_bytes is not None and measured.memory_budget_bytes > 2**30
        small = RequestCost(64 * 64, 2, 1, 0, 32 * 32)
        big = RequestCost(2048 * 2048, 1, 4, 0, 32 * 32)
        assert measured.refusal(small) is None
        tight = calibrate(adapter, device, 2048 * 2048, 600, allocator_budget_bytes=512 * MIB)
        assert tight.memory_budget_bytes is not None and tight.memory_budget_bytes < 512 * MIB
        why = tight.refusal(big)
        assert why is not None and why.budget == "memory" and "for activations" in why.message, (
            why,
            tight,
        )
    finally:
        del adapter
        gc.collect()
        torch.cuda.empty_cache()


def test_serve_with_adapters_on_cuda_draws_what_the_python_pipeline_draws(
    tmp_path: Path, demo_artifacts: dict[str, Path], lora_files: dict[str, Path]
) -> None:
    """``ditq serve --lora`` on CUDA (the doctor choosing each layer's kernel), each request's ``lora`` field
    picking its adapters, against ditq's Python pipeline on CUDA with the same adapters loaded by diffusers' own
    calls: one adapter, both at their loaded scales (the field left out), none."""
    pytest.importorskip("peft")
    ask = {"prompt": "a red circle", "size": "32x32", "num_inference_steps": 3, "seed": 1}
    pipeline = ditq.load_pipeline(demo_artifacts["fp8"], device="cuda")
    load_both_adapters(pipeline, lora_files)

    choices = [({"name": "style"}, {"style": 1.0}), (None, {"style": 1.0, "bold": 0.5}), ([], {})]
    expected = [
        drawn_with(pipeline, adapters, str(ask["prompt"])).astype(np.float64) for _, adapters in choices
    ]
    assert not np.array_equal(expected[0], expected[2]) and not np.array_equal(expected[0], expected[1])
    del pipeline
    gc.collect()
    torch.cuda.empty_cache()
    lora = ["--lora", f"style={lora_files['peft']}", "--lora", f"bold={lora_files['diffusers']}:0.5"]
    args = [str(demo_artifacts["fp8"]), *lora, "--max-pixels", str(32 * 32), "--max-references", "0"]
    with _server(tmp_path, *args, "--on-collapse", "warn") as (process, base, log):
        assert wait_healthy(base, 300, process) is None, log.read_text()[-3000:]
        with httpx.Client(base_url=base, timeout=300) as client:
            for (field, _), want in zip(choices, expected, strict=True):
                body = ask if field is None else {**ask, "lora": field}
                answer = client.post("/v1/images/generations", json=body)
                assert answer.status_code == 200, answer.text
                png = base64.b64decode(answer.json()["data"][0]["b64_json"])
                got = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(np.float64)
                assert psnr(got, want) >= 40.0, field
