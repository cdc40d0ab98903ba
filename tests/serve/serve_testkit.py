"""Pieces the serve tests share: the tiny demo pipeline behind the real adapter, apps, a live server."""

from __future__ import annotations

import functools
import io
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import tiny_models
import torch
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient
from PIL import Image

from ditq.runtime.adapter import GenerationRequest, GenerationResult, PipelineAdapter
from ditq.serve import DoctorOutcome, ServeConfig, create_app
from ditq.serve.connections import ConnectionLimits, uvicorn_config
from ditq.serve.cost import CostModel

# The tiny pipeline is untrained: its images are half-transparent noise, which the gate's
# "transparent" signature calls collapsed. Tests that want images back serve with on_collapse="warn".
WARN = ServeConfig(served_model_name="tiny", on_collapse="warn")
FAST = {"num_inference_steps": 2, "size": "32x32"}  # a request that takes about a second on the CPU


@functools.cache
def tiny_adapter() -> PipelineAdapter:
    """The tiny demo pipeline's adapter, one for the whole session (the tests here leave it as they found it)."""
    return tiny_models.tiny_adapter()


def passed_doctor(_adapter: PipelineAdapter) -> DoctorOutcome:
    return DoctorOutcome("passed", "no quantized layers: nothing for the doctor to check")


def png_bytes(
    width: int = 40, height: int = 24, colour: tuple[int, int, int, int] = (200, 30, 30, 255)
) -> bytes:
    buffer = io.BytesIO()
    image = Image.new("RGBA", (width, height), colour)
    image.paste((20, 160, 40, 255), (width // 4, height // 4, width // 2, height // 2))
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def free_port() -> int:
    """A loopback port that was free a moment ago (for a server started in another process)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def serve_process(tmp_path: Path, *args: str) -> Iterator[tuple[subprocess.Popen[str], str, Path]]:
    """``ditq serve ARGS`` in a child process on a free loopback port: the process, its base URL and the path of
    its log (stdout and stderr); sent SIGTERM on leaving, if still running."""
    port = free_port()
    log_path = tmp_path / f"serve-{port}.log"
    argv = [sys.executable, "-m", "ditq.cli", "serve", "--port", str(port), *args]
    with open(log_path, "w") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            yield process, f"http://127.0.0.1:{port}", log_path
        finally:
            if process.poll() is None:
                process.terminate()
                process.wait(60)


class GatedAdapter:
    """The real adapter, except that each call waits until ``release`` is set (to hold the worker busy)."""

    def __init__(self, adapter: PipelineAdapter) -> None:
        self.adapter = adapter
        self.release = threading.Event()
        self.entered = threading.Semaphore(0)  # one permit per call that started
        self.prompts: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.adapter, name)

    def __call__(self, request: GenerationRequest) -> GenerationResult:
        self.prompts.append(request.prompt)
        self.entered.release()
        self.release.wait(60)
        return self.adapter(request)


def make_app(
    config: ServeConfig = WARN,
    load: Callable[[], Any] = tiny_adapter,
    doctor: Callable[[PipelineAdapter], DoctorOutcome] = passed_doctor,
    calibrate: Callable[[PipelineAdapter], CostModel] | None = None,
) -> FastAPI:
    return create_app(config, load=load, doctor=doctor, model_root="/models/tiny-demo", calibrate=calibrate)


@contextmanager
def client_for(app: FastAPI, wait: bool = True) -> Iterator[TestClient]:
    with TestClient(app) as client:
        if wait:
            assert app.state.serve.wait_loaded(120), "the model did not load"
        yield client


@contextmanager
def transformer_hook(adapter: PipelineAdapter, hook: Callable[..., Any]) -> Iterator[None]:
    """A forward hook on the real transformer for the duration of the block (faults, NaN output)."""
    handle = adapter.pipeline.transformer.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def raise_once(error: BaseException) -> Callable[..., Any]:
    raised: list[bool] = []

    def hook(_module: torch.nn.Module, _args: Any, _output: Any) -> None:
        if not raised:
            raised.append(True)
            raise error

    return hook


def sleep_per_step(seconds: float) -> Callable[..., Any]:
    """A transformer hook that makes every denoising step take at least ``seconds``."""

    def hook(_module: torch.nn.Module, _args: Any, _output: Any) -> None:
        time.sleep(seconds)

    return hook


def nan_output(_module: torch.nn.Module, _args: Any, output: Any) -> Any:
    return (output[0] * float("nan"), *output[1:])


class LiveServer:
    """uvicorn on a free loopback port, in a thread, with the connection guards ``ditq serve`` uses."""

    def __init__(self, app: FastAPI, limits: ConnectionLimits | None = None) -> None:
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.bind(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        self.server = uvicorn.Server(uvicorn_config(app, limits or ConnectionLimits(), log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *_exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(60)
        self.socket.close()
