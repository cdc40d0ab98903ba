"""`ditq serve` from the command line: usage errors exit 2 naming the option; a saved model serves."""

from __future__ import annotations

import signal
import subprocess
import sys
import warnings
from pathlib import Path

import httpx
import pytest
import torch
from serve_testkit import FAST, client_for, free_port, make_app

import ditq
from ditq.cli import main
from ditq.demo import build_tiny_pipeline
from ditq.healthcheck import wait_healthy
from ditq.serve.startup import load_adapter, make_doctor


def test_max_memory_on_the_cpu_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "model_index.json").write_text("{}")
    assert main(["serve", str(tmp_path), "--max-memory", "24GiB"]) == 2
    assert "--max-memory" in capsys.readouterr().err


def test_bad_memory_size_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "model_index.json").write_text("{}")
    assert main(["serve", str(tmp_path), "--max-memory", "lots"]) == 2
    assert "cannot read 'lots'" in capsys.readouterr().err


def test_a_directory_without_model_index_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", str(tmp_path)]) == 2
    assert "model_index.json" in capsys.readouterr().err


def test_a_model_that_fails_to_load_stops_the_server_with_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "model_index.json").write_text(
        '{"_class_name": "NoSuchPipeline", "transformer": ["diffusers", "X"]}'
    )
    assert main(["serve", str(tmp_path), "--port", str(free_port())]) == 1
    assert f"loading {tmp_path} failed" in capsys.readouterr().err


@pytest.mark.slow
def test_serve_a_saved_model_directory_through_the_cli(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        build_tiny_pipeline(seed=0).save_pretrained(tmp_path / "tiny")
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ditq.cli",
            "serve",
            str(tmp_path / "tiny"),
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--on-collapse",
            "warn",
            "--served-model-name",
            "tiny-cli",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        problem = wait_healthy(base, 120, process, interval_s=0.3)
        assert problem is None, f"{problem}: {process.stderr.read() if process.stderr else ''}"
        assert httpx.get(f"{base}/v1/models").json()["data"][0]["id"] == "tiny-cli"
        response = httpx.post(f"{base}/v1/images/generations", json={"prompt": "a kite", **FAST}, timeout=120)
        assert response.status_code == 200 and response.json()["size"] == "32x32"
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)


@pytest.mark.parametrize("scheme", ["w8a8", "w8a16"])
def test_an_artifact_is_served_after_the_doctor_verified_its_paths(tmp_path: Path, scheme: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        build_tiny_pipeline(seed=0).save_pretrained(tmp_path / "tiny")
    ditq.quantize(tmp_path / "tiny", tmp_path / scheme, scheme)
    app = make_app(
        load=lambda: load_adapter(tmp_path / scheme, "cpu", "none", torch.float32),
        doctor=make_doctor(skip=False, device="cpu", dtype=torch.float32),
    )
    with client_for(app) as client:
        health = client.get("/health").json()
        assert health["status"] == "ready" and health["doctor"]["status"] == "passed"
        assert "14 quantized layers" in health["doctor"]["summary"]
        response = client.post("/v1/images/generations", json={"prompt": "a kite", "seed": 0, **FAST})
        assert response.status_code == 200 and response.json()["size"] == "32x32"
