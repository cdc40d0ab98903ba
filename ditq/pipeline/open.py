"""The one opener: ``open_pipeline(model, options)`` loads a model as ``LoadOptions`` say and hands back its adapter.

It owns every step of opening a pipeline, in this order: the options resolved (once: ``resolve_load_options``), the
components loaded and placed with each quantized Linear's kernel path chosen by the doctor's chooser
(``ditq.runtime.loader.load_components``), the prefix KV cache, compilation, then the quantized attention path
(chosen by ``ditq.doctor.attention`` where it is checked and timed, installed by ``ditq.runtime.attention``). What it found out is the adapter's
``load_facts`` (a server's /health shows them). ``ditq serve``, ``ditq generate``, the baseline, the planner and
``ditq.load_pipeline`` open pipelines here and nowhere else.

It sits above the doctor, whose choices it installs (``tests/test_layers.py`` names its layer).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from ditq.doctor import kernel_chooser
from ditq.runtime.adapter import PipelineAdapter
from ditq.runtime.loader import KernelChooser, load_components, pipeline_summary
from ditq.runtime.lora import register_with_peft
from ditq.runtime.options import LoadOptions, ResolvedLoad, resolve_load_options

__all__ = ["load_pipeline", "open_pipeline"]

log = logging.getLogger(__name__)


def open_pipeline(model: str | Path, options: LoadOptions | ResolvedLoad) -> PipelineAdapter:
    """``model`` (a plain or ditq diffusers directory, or a hub id) opened as ``options`` say; options already
    resolved (``resolve_load_options``, by a caller that needed the device first) are not resolved again.

    Each quantized layer's kernel path is chosen before the repack by the doctor (``ditq.doctor.kernel_chooser``):
    a path that fails its check is refused and the next one is used; with ``skip_doctor`` the registry's first
    candidate runs unverified. ``attention`` "auto" installs int8, else int8-fp8, only where it is faster than the
    model's own attention (``ditq.doctor.attention.choose_auto_attention``). The placement, the modules left unused,
    the KV cache's precision, compilation and the attention choice are load facts (``adapter.load_facts``).
    """
    load = options if isinstance(options, ResolvedLoad) else resolve_load_options(options)
    pipeline, chooser = _open(model, load)
    if chooser is None and any(pipeline_summary(pipeline)[1].values()):
        log.warning("--skip-doctor: kernel paths run without verification on this device")
    adapter = PipelineAdapter(pipeline)
    adapter.kernel_chooser = chooser
    adapter.load_facts.update(_load_facts(pipeline, chooser))
    if load.options.attention is not None:
        adapter.load_facts["attention"] = _install_attention(pipeline, load, chooser is not None)
    return adapter


def _open(model: str | Path, load: ResolvedLoad) -> tuple[Any, KernelChooser | None]:
    """The pipeline loaded, its KV cache and compilation installed; and the chooser its kernels came from. With
    peft installed, LoRA adapters load onto its quantized Linears (``ditq.runtime.lora``)."""
    register_with_peft()
    chooser = _chooser(load.options)
    pipeline = load_components(model, load, chooser)
    _install_kv_cache_and_compile(pipeline, load.options)
    return pipeline, chooser


def _chooser(options: LoadOptions) -> KernelChooser | None:
    """The Python API's own chooser, else the doctor's (None with ``skip_doctor``: the first candidate)."""
    if options.chooser is not None:
        return options.chooser
    if options.skip_doctor:
        return None
    return kernel_chooser(options.accumulate)


def _install_kv_cache_and_compile(pipeline: Any, options: LoadOptions) -> None:
    """``kv_cache`` (``ditq.runtime.kv_cache``), the step cache (``ditq.runtime.step_cache``), then ``compile``
    (``ditq.runtime.compile``): the transformer's repeated blocks, and the text encoder's decoder layers only where
    the text encoder is quantized."""
    if options.kv_cache is not None:
        from ditq.runtime.kv_cache import install_kv_cache

        install_kv_cache(pipeline, options.kv_cache)
    if options.cache is not None:
        from ditq.runtime.step_cache import install_step_cache

        install_step_cache(pipeline, options.cache)
    if options.compile is not None:
        from ditq.runtime.compile import compile_pipeline

        quantized = getattr(pipeline, "ditq_quantized_components", ())
        compile_pipeline(
            pipeline, options.compile, text_encoder="text_encoder" if "text_encoder" in quantized else None
        )


def _load_facts(pipeline: Any, chooser: KernelChooser | None) -> dict[str, Any]:
    """What loading found out, as /health and ``ditq generate`` show it."""
    facts: dict[str, Any] = {}
    placement = getattr(pipeline, "ditq_placement", None)
    if placement is not None:  # the object itself: calibration may demote it; /health shows it as it is then
        facts["placement"] = placement
    facts["unused"] = dict(getattr(pipeline, "ditq_unused", {}))
    facts["kv_cache"] = getattr(pipeline, "ditq_kv_cache", None)
    facts["compile"] = getattr(pipeline, "ditq_compile", None)  # its warm-up is filled in later
    step_cache = getattr(pipeline, "ditq_step_cache", None)
    facts["cache"] = None if step_cache is None else str(step_cache.spec)
    seconds = getattr(chooser, "seconds", None)
    if seconds is not None:  # part of the load time: the doctor's checks, kernel compilation included
        facts["kernel_choice_seconds"] = round(seconds, 3)
    facts["accumulate"] = getattr(chooser, "accumulate", "exact")
    return facts


def _install_attention(pipeline: Any, load: ResolvedLoad, verify: bool) -> str:
    """The quantized attention path ``load.options.attention`` names (or "auto"'s timed choice): the doctor
    chooses it per shape (``attention_chooser``), the runtime installs it through the model's family
    (``ditq.runtime.attention.install_attention``); its summary line."""
    from ditq.doctor.attention import attention_chooser
    from ditq.runtime.attention import install_attention

    kind = str(load.options.attention)
    choice = install_attention(pipeline, kind, attention_chooser(kind, load.device, load.dtype, verify))
    return str(choice.summary())


def load_pipeline(
    model_dir: str | Path,
    device: str | torch.device = "auto",
    offload: str = "none",
    dtype: torch.dtype | str | None = None,
    chooser: KernelChooser | None = None,
    variant: str | None = None,
    drop_unused: bool = True,
    memory_budget_bytes: int | None = None,
    kv_cache: str | None = None,
    compile: str | None = None,
    fuse: bool = False,
    local_files_only: bool = False,
) -> Any:
    """``ditq.load_pipeline``: a diffusers pipeline from a plain or ditq directory, or a hub id, opened by
    ``open_pipeline`` with these keywords as its ``LoadOptions`` (their meaning there). ``chooser`` decides each
    quantized layer's kernel path (None: the registry's first candidate, unverified, as ``skip_doctor``). The
    pipeline comes back as diffusers made it, without the adapter ``open_pipeline`` wraps it in (which turns off
    diffusers' own progress bar)."""
    options = LoadOptions(
        device=str(device),
        dtype=dtype if dtype is None or isinstance(dtype, str) else str(dtype).removeprefix("torch."),
        offload=offload,
        memory_budget_bytes=memory_budget_bytes,
        variant=variant,
        skip_doctor=chooser is None,
        kv_cache=kv_cache,
        compile=compile,
        fuse=fuse,
        drop_unused=drop_unused,
        local_files_only=local_files_only,
        chooser=chooser,
    )
    return _open(model_dir, resolve_load_options(options))[0]
