"""``serve()``: load a model directory and serve it over HTTP with uvicorn until SIGTERM/SIGINT.

The first SIGTERM (or Ctrl-C) drains: the server keeps listening and answers new requests 503 ``draining``
(Connection: close) while the queued and running ones finish, for at most ``drain_timeout_s``; then what is
left is stopped (a running generation at its next step, answered 503 ``draining``) and the process exits,
giving connections ``GRACEFUL_CLOSE_S`` to take their answers. A second signal exits at once. A signal before
the model is ready (loading, the doctor's checks, calibration) stops the server and exits with code 5
(``EXIT_STOPPED_DURING_STARTUP``) without waiting for the model.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

import torch
import uvicorn
from fastapi import FastAPI

from ditq.checkpoint.seal import MANIFEST
from ditq.errors import (
    EXIT_STOPPED_DURING_STARTUP,
    InputError,
    OutOfMemoryError,
    StartupError,
)
from ditq.fsutil import sha256_file
from ditq.pipeline.open import open_pipeline
from ditq.runtime.adapter import PipelineAdapter
from ditq.runtime.lora_adapters import LoraSpec, load_lora_adapters, refuse_beside_lora
from ditq.runtime.options import LoadOptions, ResolvedLoad, resolve_load_options
from ditq.runtime.parallel import ParallelSpec, check_parallel, rank_devices, refuse_beside_parallel
from ditq.serve.access import exposure_warning
from ditq.serve.app import create_app
from ditq.serve.config import ServeConfig
from ditq.serve.connections import ConnectionLimits, uvicorn_config
from ditq.serve.cost import CostModel, calibrate
from ditq.serve.ranks import RankGroup, RankSettings
from ditq.serve.startup import make_doctor
from ditq.serve.state import OVERDUE_GRACE_S, ServerState

__all__ = ["DrainingServer", "serve", "serving_app"]

logger = logging.getLogger(__name__)

_WORKER_JOIN_S = 5.0  # at exit, after the drain: the worker thread is idle or stopping


class DrainingServer(uvicorn.Server):
    """uvicorn's server, draining on the first stop signal instead of closing its listening socket."""

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout_s: float = 30.0) -> None:
        super().__init__(config)
        self.state = state
        self.drain_timeout_s = drain_timeout_s
        self.drain_deadline: float | None = None
        self._stopping_since: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain_deadline is None and not self.should_exit:
            self.state.begin_drain()
            self.drain_deadline = time.monotonic() + self.drain_timeout_s
            return
        super().handle_exit(sig, frame)  # a second signal: exit now

    async def on_tick(self, counter: int) -> bool:
        if self.drain_deadline is not None and not self.should_exit:
            now = time.monotonic()
            if self.state.drained:
                self.should_exit = True
            elif now > self.drain_deadline and self._stopping_since is None:
                logger.warning("drain timeout of %g s passed: stopping what is left", self.drain_timeout_s)
                self.state.stop_pending()
                self._stopping_since = now
            elif self._stopping_since is not None and now - self._stopping_since > OVERDUE_GRACE_S:
                logger.error("a generation did not stop within %g s; exiting without it", OVERDUE_GRACE_S)
                self.should_exit = True
        return await super().on_tick(counter)


def _listen(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound now; an address in use is a StartupError naming it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise StartupError(f"cannot listen on {host}:{port}: {error.strerror or error}") from error
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(
    model_dir: Path | None,
    config: ServeConfig,
    options: LoadOptions,
    host: str = "127.0.0.1",
    port: int = 8091,
    limits: ConnectionLimits | None = None,
    drain_timeout_s: float = 30.0,
    parallel: ParallelSpec | None = None,
    lora: Sequence[LoraSpec] = (),
) -> None:
    """Serve ``model_dir`` (an artifact or a plain diffusers directory; None: the bundled demo model), opened as
    ``options`` say (``ditq.pipeline.open.open_pipeline``; with ``compile``, calibration runs each shape once to
    compile and warm it up before measuring it). ``parallel`` (cp=N, tp=N) serves over N ranks, one device each,
    this process being rank 0 (``ditq.serve.ranks``). ``lora``: adapters loaded once the model is open, before the
    cost model is measured (``serving_app``).

    Raises OutOfMemoryError (exit code 3) when the model does not fit in the accelerator memory it may use.
    """
    if model_dir is None:
        from ditq.demo import default_model_dir

        model_dir = default_model_dir()
    if (warning := exposure_warning(host, config.api_key, config.allowed_hosts)) is not None:
        logger.warning(warning)
    app, ranks = serving_app(model_dir, config, options, parallel, lora)
    state: ServerState = app.state.serve
    failures: list[tuple[str, bool]] = []
    listening = _listen(host, port)  # before the model loads: a taken port is one line and its own exit code
    uvicorn_settings = uvicorn_config(
        app, limits or ConnectionLimits(), host=host, port=port, log_level="info"
    )
    server = DrainingServer(uvicorn_settings, state, drain_timeout_s)

    def stop_on_failure(message: str, out_of_memory: bool) -> None:
        failures.append((message, out_of_memory))
        server.should_exit = True

    state.on_load_failure = stop_on_failure
    logger.info("serving %s as '%s' on http://%s:%d", model_dir, config.served_model_name, host, port)
    if ranks is not None:
        ranks.launch()
    try:
        server.run(sockets=[listening])
    finally:
        # a failed load has reported itself (its thread ends a moment later); otherwise the thread may still load
        loading = not failures and not state.wait_loaded(0)
        # A follower ignores SIGTERM, and the interpreter's exit joins its children: a follower left running
        # would hang this process's exit. So the group is closed, or its followers killed where rank 0 still loads.
        if ranks is not None and loading:
            ranks.abandon()
        elif ranks is not None:
            ranks.close()
    if loading:
        _exit_during_startup(state)
    if failures:
        message, out_of_memory = failures[-1]
        raise OutOfMemoryError(message) if out_of_memory else StartupError(message)


def serving_app(
    model_dir: Path,
    config: ServeConfig,
    options: LoadOptions,
    parallel: ParallelSpec | None = None,
    lora: Sequence[LoraSpec] = (),
) -> tuple[FastAPI, RankGroup | None]:
    """The app ``serve`` runs (its arguments as ``serve`` reads them), and with ``parallel`` the group of ranks it
    serves over, not yet launched (``RankGroup.launch``: the followers start loading; the app's start-up loads rank
    0 and waits for them). The options are resolved here, once: the device, the dtype and the memory cap.

    ``lora``'s adapters load once the model is open, all of them active at their scales, so that calibration measures
    the costliest choice a request can make and the memory budget is what is left beside them; /health shows them and
    their bytes (``lora``) and so does the cost model (``adapter_bytes``)."""
    if not (model_dir / "model_index.json").is_file():
        raise InputError(f"{model_dir}: no model_index.json (not a diffusers model directory)")
    if lora:
        refuse_beside_lora("served", options.offload, options.compile, ("--parallel", parallel is not None))
    if parallel is not None:
        refuse_beside_parallel(
            parallel, options.offload, options.max_memory, options.attention, options.compile, options.cache
        )
    load = resolve_load_options(options)
    ranks = None if parallel is None else _rank_group(model_dir, parallel, load)
    device = ranks.settings.devices[0] if ranks is not None else load.options.device
    cap = load.memory_cap

    def measure_costs(adapter: PipelineAdapter) -> CostModel:
        allocator_bytes = cap.allocator_bytes if cap is not None else None
        return calibrate(
            adapter, torch.device(device), config.max_pixels, config.request_timeout_s, allocator_bytes
        )

    def load_model() -> PipelineAdapter:
        adapter = ranks.join() if ranks is not None else open_pipeline(model_dir, load)
        if lora:
            adapter.lora = load_lora_adapters(adapter.pipeline, lora)
            adapter.load_facts["lora"] = adapter.lora
            loaded = adapter.lora.loaded.values()
            logger.info(
                "LoRA adapters loaded, all active unless a request picks: %s",
                ", ".join(
                    f"{a.name} x{a.scale:g} ({a.layers} layers, {a.parameter_bytes} bytes)" for a in loaded
                ),
            )
        # --max-references: fewer than the pipeline takes, calibrated so
        if config.max_references is not None:
            adapter.max_reference_images = min(adapter.max_reference_images, config.max_references)
        return adapter

    app = create_app(
        config,
        load=load_model,
        doctor=make_doctor(),
        model_root=str(model_dir),
        drain_timeout_s=_WORKER_JOIN_S,
        facts=_facts(model_dir, load, device, ranks),
        calibrate=measure_costs,
        ranks=ranks,
    )
    return app, ranks


def _facts(model_dir: Path, load: ResolvedLoad, device: str, ranks: RankGroup | None) -> dict[str, Any]:
    """What the probe records in RUN.json (and the report chains to CANDIDATE.json's artifact digest), known before
    the model loads."""
    manifest = model_dir / MANIFEST
    options = load.options
    return {
        "artifact_digest": sha256_file(manifest) if manifest.is_file() else None,
        "device": device,
        "offload": options.offload,
        "dtype": options.dtype,
        "max_memory": load.memory_cap.to_json() if load.memory_cap is not None else None,
        **({"allocator": load.allocator} if load.allocator is not None else {}),
        **({"variant": options.variant} if options.variant is not None else {}),
        **({"parallel": ranks} if ranks is not None else {}),  # shown as it is at each /health
    }


def _rank_group(model_dir: Path, spec: ParallelSpec, load: ResolvedLoad) -> RankGroup:
    """The ranks of ``--parallel``, one device each; a model or device it cannot serve is refused in one line."""
    check_parallel(model_dir, spec, load.device)
    devices = rank_devices(spec, load.device)
    settings = RankSettings(model_dir, spec, tuple(devices), load.options, logger.getEffectiveLevel())
    return RankGroup(settings)


def _exit_during_startup(state: ServerState) -> NoReturn:
    """A stop signal came while the model was loading, being checked or calibrated. That work runs in torch in
    the loader thread and cannot be interrupted; a normal interpreter exit would tear torch's native thread
    pools down under it (SIGABRT: "terminate called without an active exception"). So the process ends now,
    with its own exit code, after the log is flushed; it holds nothing that needs a clean close."""
    logger.warning(
        "stopped during start-up, before %s was ready (%s); exiting without waiting for it",
        state.config.served_model_name,
        state.startup_step,
    )
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_STOPPED_DURING_STARTUP)
