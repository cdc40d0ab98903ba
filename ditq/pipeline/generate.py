"""One request run in process: what ``ditq generate`` runs.

The model opens as ``ditq serve`` opens it (``ditq.pipeline.open.open_pipeline``: the same placement, kernel choice,
quantized attention and KV cache), then one request runs through the adapter and is timed; the same code path
for an artifact and for a plain diffusers directory (BF16 simply has no quantized layers). Without a directory it
uses the bundled demo model. It sits beside the opener, above the doctor (``tests/test_layers.py``).
"""

from __future__ import annotations

import dataclasses
import io
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from ditq.errors import InputError
from ditq.fsutil import atomic_write_bytes
from ditq.pipeline.open import open_pipeline
from ditq.progress import progress_bar
from ditq.runtime.adapter import GenerationRequest, GenerationResult, PipelineAdapter
from ditq.runtime.compile import compiled_graphs
from ditq.runtime.loader import pipeline_summary
from ditq.runtime.lora_adapters import LoadedLora, LoraSpec, load_lora_adapters, refuse_beside_lora
from ditq.runtime.options import LoadOptions, resolve_load_options

__all__ = ["GenerationReport", "generate", "save_images"]

log = logging.getLogger(__name__)


@dataclass
class GenerationReport:
    model_dir: Path
    device: str
    offload: str
    quantized: dict[str, dict[str, int]]  # component -> scheme -> quantized Linear count
    kernels: dict[str, int]  # kernel path -> layer count
    attention: str | None  # the quantized-attention choice (summary line); None: stock attention
    placement: dict[str, Any] | None  # offload auto: what is resident, streamed, tiled (Placement.to_json)
    unused: dict[str, int]  # component.module -> bytes, left out of the loaded model (the manifest's unused)
    load_seconds: float
    load_peak_memory_bytes: int | None  # accelerator, while loading (None on CPU)
    result: GenerationResult
    compile: dict[str, Any] | None = None  # --compile: backend, what, warm-up seconds (CompileFacts.to_json)
    cache: str | None = None  # --cache: the step cache's setting (``ditq.runtime.step_cache``); None: none
    lora: tuple[LoadedLora, ...] = ()  # --lora: the adapters the image was drawn with, each at its scale then


def _run(adapter: PipelineAdapter, request: GenerationRequest) -> GenerationResult:
    """One request; under ``--offload auto`` a request that runs out of memory makes the placement take its next
    step (``Placement.demote``) and runs again, until it fits or nothing is left to move."""
    from ditq.runtime.memory import free_accelerator_memory, is_out_of_memory

    placement = getattr(adapter.pipeline, "ditq_placement", None)
    while True:
        try:
            return adapter(request)
        except Exception as error:
            if placement is None or not is_out_of_memory(error):
                raise
            free_accelerator_memory()
            if placement.demote(adapter.pipeline, adapter.failed_stage(error)) is None:
                raise
            log.warning("out of memory: %s; running the request again", placement.steps[-1])


def generate(
    model_dir: str | Path | None,
    request: GenerationRequest,
    options: LoadOptions,
    progress: bool = True,
    lora: Sequence[LoraSpec] = (),
) -> GenerationReport:
    """Open ``model_dir`` (None: the bundled demo model) as ``options`` say and run one request; nothing is written.
    ``lora``'s adapters load once the model is open, as ``ditq serve --lora`` loads them, and the request runs with
    each at its scale (unless ``request.lora`` chooses); they are refused beside an offload or compilation first.

    Under ``offload="auto"`` a request that runs out of memory moves the placement one step and runs again.
    ``progress`` draws a bar of the denoising steps on a terminal (never in a log). With ``compile`` the transformer
    is warmed up with a two-step call at the request's shape first, so the timed request runs compiled code (the
    warm-up's seconds are reported apart).
    """
    from ditq.demo import default_model_dir

    if lora:
        refuse_beside_lora("run", options.offload, options.compile)
    directory = Path(model_dir) if model_dir is not None else default_model_dir()
    load = resolve_load_options(options)
    torch_device = load.device
    if torch_device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(torch_device)
    start = time.perf_counter()
    adapter = open_pipeline(directory, load)
    steps = request.num_inference_steps
    if steps is not None and (why := adapter.steps_refusal(steps)):  # a NaN image, said before it is drawn
        raise InputError(f"--steps {steps}: {why}")
    if lora:
        adapter.lora = load_lora_adapters(adapter.pipeline, lora)
    pipeline = adapter.pipeline
    load_seconds = time.perf_counter() - start
    compiled = getattr(pipeline, "ditq_compile", None)
    if compiled is not None:  # the first call at a shape compiles: not the request's own time
        begun, graphs = time.perf_counter(), compiled_graphs()
        warm_steps = min(2, request.num_inference_steps or adapter.default_steps)
        _run(adapter, dataclasses.replace(request, num_inference_steps=warm_steps, should_stop=None))
        compiled.warmed_up(time.perf_counter() - begun, graphs)
    load_peak = int(torch.cuda.max_memory_allocated(torch_device)) if torch_device.type == "cuda" else None
    quantized, kernels = pipeline_summary(pipeline)
    total = request.num_inference_steps or adapter.default_steps
    with progress_bar(total, "denoising", "step", enabled=progress) as bar:
        asked = request.should_stop

        def tick() -> str | None:
            bar.update()
            return asked() if asked is not None else None

        result = _run(adapter, dataclasses.replace(request, should_stop=tick))
    placement = getattr(pipeline, "ditq_placement", None)
    return GenerationReport(
        model_dir=directory,
        device=str(torch_device),
        offload=load.options.offload,
        quantized=quantized,
        kernels=kernels,
        attention=adapter.load_facts.get("attention"),
        placement=None if placement is None else placement.to_json(),
        unused=dict(getattr(pipeline, "ditq_unused", {})),
        load_seconds=load_seconds,
        load_peak_memory_bytes=load_peak,
        result=result,
        compile=None if compiled is None else compiled.to_json(),
        cache=adapter.load_facts.get("cache"),
        lora=_drawn_with(adapter, request),
    )


def _drawn_with(adapter: PipelineAdapter, request: GenerationRequest) -> tuple[LoadedLora, ...]:
    """The adapters ``request`` ran with (``LoraAdapters.resolve``: every one loaded at its scale, unless the request
    chose), each at the scale it ran at."""
    if adapter.lora is None:
        return ()
    loaded = adapter.lora.loaded
    return tuple(
        dataclasses.replace(loaded[name], scale=scale) for name, scale in adapter.lora.resolve(request.lora)
    )


def save_images(images: list[Image.Image], out: Path) -> list[Path]:
    """Write PNGs atomically: ``out`` for one image, ``stem-N.suffix`` for several."""
    paths = (
        [out]
        if len(images) == 1
        else [out.with_name(f"{out.stem}-{i}{out.suffix}") for i in range(len(images))]
    )
    for image, path in zip(images, paths, strict=True):
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        atomic_write_bytes(path, buffer.getvalue())
    return paths
