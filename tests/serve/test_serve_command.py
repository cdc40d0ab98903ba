"""`ditq serve` from the command line: usage errors exit 2 naming the option; a saved model serves."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from serve_testkit import FAST, client_for, free_port, make_app
from tiny_models import save_tiny_pipeline

import ditq
from ditq.cli import main
from ditq.pipeline.open import open_pipeline
from ditq.runtime.options import LoadOptions
from ditq.serve.startup import make_doctor
from ditq.sweep.health import wait_healthy


def test_max_memory_on_the_cpu_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "model_index.json").write_text("{}")
    assert main(["serve", str(tmp_path), "--max-memory", "24GiB"]) == 2
    assert "--max-memory" in capsys.readouterr().err


def test_bad_memory_size_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "model_index.json").write_text("{}")
    assert main(["serve", str(tmp_path), "--max-memory", "lots"]) == 2
    assert "cannot read 'lots'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("option", "value", "named"),
    [
        ("--max-connections", "0", "--max-connections"),
        ("--header-timeout", "0", "--header-timeout"),
        ("--drain-timeout", "-1", "--drain-timeout"),
        ("--api-key", " ", "--api-key: the API key must not be empty"),
        ("--api-key", " sk-padded", "--api-key: the API key has white space at its start or end"),
        (
            "--api-key",
            "sk-clé",
            "--api-key: the API key has a character that is not printable ASCII (character 6)",
        ),
    ],
)
def test_bad_connection_and_access_options_are_usage_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str, value: str, named: str
) -> None:
    (tmp_path / "model_index.json").write_text("{}")
    assert main(["serve", str(tmp_path), option, value]) == 2
    assert named in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["--parallel", "cp=1"], "--parallel 'cp=1': expected cp=N or tp=N with N at least 2"),
        (["--parallel", "cp=2", "--offload", "model"], "--parallel cp=2 with --offload model: not supported"),
        (
            ["--parallel", "cp=2", "--attention", "int8"],
            "--parallel cp=2 with --attention int8: not supported",
        ),
        (
            ["--parallel", "tp=2", "--device", "cpu"],
            "--parallel tp=2: diffusers' tensor parallelism runs on CUDA only",
        ),
    ],
)
def test_a_parallel_server_it_cannot_start_is_one_line_before_any_process_starts(
    demo_artifacts: dict[str, Path], capsys: pytest.CaptureFixture[str], extra: list[str], named: str
) -> None:
    assert main(["serve", str(demo_artifacts["source"]), "--port", str(free_port()), *extra]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert named in line


def test_the_api_key_may_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from ditq.commands import serve as serve_command

    monkeypatch.setenv("DITQ_API_KEY", "sk-from-env")
    parser = argparse.ArgumentParser()
    serve_command.add_arguments(parser)
    assert (
        serve_command.api_key(parser.parse_args([])) == "sk-from-env"
    )  # kept off the command line, out of `ps`
    assert serve_command.api_key(parser.parse_args(["--api-key", "sk-flag"])) == "sk-flag"


@pytest.mark.parametrize(
    ("key", "problem"),
    [("sk-key\n", "white space at its start or end"), ("sk-\u00e9", "not printable ASCII")],
)
def test_a_key_from_the_environment_that_can_never_match_is_a_usage_error_naming_it(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    key: str,
    problem: str,
) -> None:
    """Such a key was accepted at start-up, and then every request was 401."""
    (tmp_path / "model_index.json").write_text("{}")
    monkeypatch.setenv("DITQ_API_KEY", key)
    assert main(["serve", str(tmp_path)]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("ditq serve: error: DITQ_API_KEY: the API key ")
    assert problem in error[0] and key.strip() not in error[0]


def test_a_directory_without_model_index_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", str(tmp_path)]) == 2
    assert "model_index.json" in capsys.readouterr().err


def test_a_model_that_fails_to_load_stops_the_server_with_exit_4(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "model_index.json").write_text(
        '{"_class_name": "NoSuchPipeline", "transformer": ["diffusers", "X"]}'
    )
    assert main(["serve", str(tmp_path), "--port", str(free_port())]) == 4  # a start-up failure (README)
    assert f"loading {tmp_path} failed" in capsys.readouterr().err
    logged = [r for r in caplog.records if "failed" in r.getMessage()]
    assert logged and not any(
        r.exc_info for r in logged
    )  # an InputError is its one line, logged without a traceback


@pytest.mark.slow
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_serve_a_saved_model_directory_through_the_cli(tmp_path: Path, compiled: bool) -> None:
    save_tiny_pipeline(tmp_path / "tiny")
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
            # dynamo traces the blocks (the eager backend generates no code, so the test stays fast)
            *(["--compile", "--compile-backend", "eager", "--max-pixels", "1024"] if compiled else []),
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
        facts = httpx.get(f"{base}/health").json()["compile"]
        if compiled:  # compiled and warmed up at every calibrated shape before it was ready
            assert facts["backend"] == "eager" and facts["how"].startswith("repeated blocks (")
            assert facts["warmup_seconds"] > 0
        else:
            assert facts is None
        response = httpx.post(f"{base}/v1/images/generations", json={"prompt": "a kite", **FAST}, timeout=120)
        assert response.status_code == 200 and response.json()["size"] == "32x32"
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)


@pytest.mark.parametrize("scheme", ["w8a8", "w8a16"])
def test_an_artifact_is_served_after_the_doctor_verified_its_paths(tmp_path: Path, scheme: str) -> None:
    save_tiny_pipeline(tmp_path / "tiny")
    ditq.quantize(tmp_path / "tiny", tmp_path / scheme, scheme)
    app = make_app(
        load=lambda: open_pipeline(tmp_path / scheme, LoadOptions(device="cpu", dtype="float32")),
        doctor=make_doctor(),
    )
    with client_for(app) as client:
        health = client.get("/health").json()
        assert health["status"] == "ready" and health["doctor"]["status"] == "passed"
        assert "14 quantized layers" in health["doctor"]["summary"]
        response = client.post("/v1/images/generations", json={"prompt": "a kite", "seed": 0, **FAST})
        assert response.status_code == 200 and response.json()["size"] == "32x32"


@pytest.fixture
def nan_w8a16_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """A CPU w8a16 path ahead of the reference in the registry that returns NaN: the seed's broken kernel."""
    from ditq.kernels import get_kernel, register_kernel, unregister_kernel
    from ditq.schemes import W8A16

    monkeypatch.setenv("DITQ_CACHE_DIR", str(tmp_path / "doctor-cache"))
    reference = get_kernel("cpu-reference-w8a16")
    name = "test-serve-nan-w8a16"
    register_kernel(name=name, scheme=W8A16, device_type="cpu", prepare=reference.prepare, priority=100)(
        lambda x, prepared, bias: reference.matmul(x, prepared, bias) * float("nan")
    )
    yield name
    unregister_kernel(name)


def test_serve_falls_back_from_a_failing_w8a16_path_chosen_before_the_repack(
    tmp_path: Path, nan_w8a16_path: str
) -> None:
    from ditq.pipeline.open import load_pipeline
    from ditq.runtime.modules import quantized_linears

    save_tiny_pipeline(tmp_path / "tiny")
    ditq.quantize(tmp_path / "tiny", tmp_path / "w8a16", "w8a16")
    # Unverified (--skip-doctor), the registry's first path is repacked and returns NaN.
    unverified = load_pipeline(tmp_path / "w8a16", "cpu", dtype=torch.float32, chooser=None)
    layer = next(iter(quantized_linears(unverified.transformer).values()))
    assert layer.kernel is not None and layer.kernel.name == nan_w8a16_path
    assert torch.isnan(layer(torch.randn(2, layer.in_features))).all()

    # ditq serve's order: the doctor chooses each layer's path before the repack, refuses the NaN path and
    # falls back to the reference; its outcome records that choice.
    app = make_app(
        load=lambda: open_pipeline(tmp_path / "w8a16", LoadOptions(device="cpu", dtype="float32")),
        doctor=make_doctor(),
    )
    with client_for(app) as client:
        health = client.get("/health").json()
        assert health["status"] == "ready" and health["doctor"]["status"] == "passed", health
        assert health["doctor"]["summary"].startswith("14 quantized layers")
        assert health["doctor"]["summary"].endswith(
            f"verified paths: cpu-reference-w8a16; refused: {nan_w8a16_path}"
        )
        assert health["kernel_paths"] == {"cpu-reference-w8a16": 14}
        assert 0 < health["kernel_choice_seconds"] <= health["load_seconds"]  # the checks, timed apart
        layers = quantized_linears(app.state.serve.adapter.pipeline.transformer).values()
        assert {layer.kernel.name for layer in layers} == {"cpu-reference-w8a16"}
        response = client.post("/v1/images/generations", json={"prompt": "a kite", "seed": 0, **FAST})
        assert response.status_code == 200, response.text


def test_a_taken_port_is_one_line_and_its_own_exit_code_before_the_model_loads(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Exit code 4, not 3 (3 means "does not fit", which the sweep answers with more offload)."""
    import socket

    from ditq.errors import EXIT_OUT_OF_MEMORY, EXIT_STARTUP

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main(["serve", "--port", str(port), "--device", "cpu"])
    assert code == EXIT_STARTUP != EXIT_OUT_OF_MEMORY
    error = capsys.readouterr().err.strip().splitlines()
    assert error == [f"ditq serve: error: cannot listen on 127.0.0.1:{port}: Address already in use"]


@pytest.mark.slow
def test_sigterm_while_the_model_loads_exits_with_its_own_code_not_an_abort() -> None:
    """Issue 28, defect 12: SIGTERM during start-up (loading, the doctor, calibration) aborted: exit -6,
    "terminate called without an active exception", torch's native threads torn down under the loader thread.
    The loader starts with the application; loading and calibrating the demo model take seconds."""
    from ditq.errors import EXIT_STOPPED_DURING_STARTUP

    process = subprocess.Popen(
        [sys.executable, "-m", "ditq.cli", "serve", "--port", str(free_port()), "--device", "cpu"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stderr is not None
    try:
        seen = []
        while (line := process.stderr.readline()) and "Application startup complete" not in line:
            seen.append(line)
        assert line, "".join(seen)
        process.send_signal(signal.SIGTERM)
        code = process.wait(30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    rest = process.stderr.read()
    assert code == EXIT_STOPPED_DURING_STARTUP, rest
    assert re.search(
        r"stopped during start-up, before ditq-demo was ready \((loading|checking kernels|calibrating)\)",
        rest,
    )
    assert "terminate called" not in rest


def test_fast_accumulation_without_the_doctor_is_refused_before_the_server_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 43: fast accumulation is chosen by the doctor's measurement; with --skip-doctor there is none."""
    assert main(["serve", "--accumulate", "fast", "--skip-doctor", "--port", "0"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "ditq serve: error: --accumulate fast: fast accumulation serves only where the kernel doctor measured it; "
        "drop --skip-doctor"
    ]
