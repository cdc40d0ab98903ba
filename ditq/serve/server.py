"""``serve()``: load a model directory and serve it over HTTP with uvicorn until SIGTERM/SIGINT.

SIGTERM (or Ctrl-C) drains: new requests get 503 ``draining``, the queued and running ones finish,
then the process exits.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import FrameType

import torch
import uvicorn

from ditq.errors import DitqError, InputError, OutOfMemoryError
from ditq.serve.app import create_app
from ditq.serve.config import ServeConfig
from ditq.serve.startup import apply_memory_cap, load_adapter, make_doctor
from ditq.serve.state import ServerState

__all__ = ["DrainingServer", "serve"]

logger = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, telling the app to stop taking requests as soon as a stop signal arrives."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.state.begin_drain()
        super().handle_exit(sig, frame)


def serve(
    model_dir: Path | None,
    config: ServeConfig,
    host: str = "127.0.0.1",
    port: int = 8091,
    device: str = "cpu",
    offload: str = "none",
    dtype: str = "bfloat16",
    max_memory: str | None = None,
    skip_doctor: bool = False,
) -> None:
    """Serve ``model_dir`` (an artifact or a plain diffusers directory; None: the bundled demo model).

    Raises OutOfMemoryError (exit code 3) when the model does not fit in the accelerator memory it may use.
    """
    if model_dir is None:
        from ditq.demo import default_model_dir

        model_dir = default_model_dir()
    if not (model_dir / "model_index.json").is_file():
        raise InputError(f"{model_dir}: no model_index.json (not a diffusers model directory)")
    cap = apply_memory_cap(max_memory, device)
    failures: list[tuple[str, bool]] = []
    facts = {
        "device": cap.device if cap is not None else device,
        "offload": offload,
        "dtype": dtype,
        "max_memory": cap.to_json() if cap is not None else None,
    }
    app = create_app(
        config,
        load=lambda: load_adapter(model_dir, device, offload, getattr(torch, dtype), skip_doctor),
        doctor=make_doctor(skip_doctor, device, getattr(torch, dtype)),
        model_root=str(model_dir),
        drain_timeout_s=config.request_timeout_s,
        facts=facts,
    )
    state: ServerState = app.state.serve
    server = DrainingServer(uvicorn.Config(app, host=host, port=port, log_level="info"), state)

    def stop_on_failure(message: str, out_of_memory: bool) -> None:
        failures.append((message, out_of_memory))
        server.should_exit = True

    state.on_load_failure = stop_on_failure
    logger.info("serving %s as '%s' on http://%s:%d", model_dir, config.served_model_name, host, port)
    server.run()
    if failures:
        message, out_of_memory = failures[-1]
        raise OutOfMemoryError(message) if out_of_memory else DitqError(message)
