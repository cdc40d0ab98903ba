"""What runs before the first request: loading the model and the kernel doctor's start-up check."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch

from ditq.doctor import startup_check
from ditq.errors import InputError
from ditq.runtime.adapter import PipelineAdapter
from ditq.serve.config import parse_memory_size
from ditq.serve.state import DoctorOutcome

__all__ = ["apply_memory_cap", "load_adapter", "make_doctor"]

logger = logging.getLogger(__name__)


def apply_memory_cap(max_memory: str | None, device: str) -> int | None:
    """Cap this process's accelerator memory at ``max_memory`` (e.g. '24GiB') on a CUDA device, so the
    capacity of a smaller card can be tested on a larger one. Returns the cap in bytes."""
    if max_memory is None:
        return None
    size = parse_memory_size(max_memory)
    torch_device = torch.device(device)
    if torch_device.type != "cuda":
        raise InputError(f"--max-memory caps accelerator memory; device '{device}' has none to cap")
    total = torch.cuda.get_device_properties(torch_device).total_memory
    fraction = min(1.0, size / total)
    torch.cuda.set_per_process_memory_fraction(fraction, torch_device)
    logger.info(
        "accelerator memory capped at %.2f GiB (%.1f%% of %.2f GiB)",
        size / 1024**3,
        fraction * 100,
        total / 1024**3,
    )
    return size


def load_adapter(model_dir: Path, device: str, offload: str, dtype: torch.dtype) -> PipelineAdapter:
    """An artifact or a plain diffusers directory, through the runtime loader."""
    from ditq.runtime.loader import load_pipeline

    return PipelineAdapter(load_pipeline(model_dir, device=device, offload=offload, dtype=dtype))


def make_doctor(skip: bool, device: str, dtype: torch.dtype) -> Callable[[PipelineAdapter], DoctorOutcome]:
    """The start-up check: the kernel doctor verifies (or replaces) the path of every quantized layer."""

    def check(adapter: PipelineAdapter) -> DoctorOutcome:
        if skip:
            logger.warning("--skip-doctor: kernel paths are trusted without the doctor's check")
            return DoctorOutcome("skipped", "--skip-doctor given")
        passed, summary = startup_check(adapter.pipeline, torch.device(device), dtype)
        logger.info("kernel doctor: %s", summary)
        return DoctorOutcome("passed" if passed else "failed", summary)

    return check
