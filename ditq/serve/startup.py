"""What runs before the first request: the memory budget, loading the model with doctor-verified kernel
paths, and the doctor's record of what it chose."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ditq.devices import resolve_device
from ditq.doctor import VerifiedChooser
from ditq.errors import InputError
from ditq.runtime.adapter import PipelineAdapter
from ditq.serve.config import parse_memory_size
from ditq.serve.state import DoctorOutcome

__all__ = ["MemoryCap", "apply_memory_cap", "load_adapter", "make_doctor"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryCap:
    """A process budget on one CUDA device: what the allocator may hold, after what lives outside it."""

    device: str  # with its index, e.g. cuda:1
    budget_bytes: int  # --max-memory: everything this process may hold on the device
    outside_allocator_bytes: int  # CUDA context and libraries, measured at start-up
    allocator_bytes: int  # the caching allocator's cap: budget - outside
    device_total_bytes: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _process_bytes_on(device: torch.device) -> int | None:
    """This process's memory on ``device`` as the driver counts it (NVML), or None where it cannot say."""
    try:
        import pynvml

        pynvml.nvmlInit()
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        handle = next(
            pynvml.nvmlDeviceGetHandleByIndex(i)
            for i in range(pynvml.nvmlDeviceGetCount())
            if str(pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))).endswith(uuid)
        )
        for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if process.pid == os.getpid() and process.usedGpuMemory is not None:
                return int(process.usedGpuMemory)
    except Exception:  # no NVML, another driver, a sandbox that hides processes: the caller falls back
        return None
    return None


def apply_memory_cap(max_memory: str | None, device: str) -> MemoryCap | None:
    """Cap what this process holds on a CUDA device at ``max_memory`` (e.g. '24GiB'), so the capacity of a
    smaller card can be tested on a larger one.

    The budget covers the whole process as the driver counts it: the CUDA context and the libraries' own
    memory (measured here, after one cuBLAS call, through NVML; where NVML cannot see this process, the
    device's used memory is taken, which also counts other processes and so errs on the safe side) are
    taken off, and the caching allocator gets the rest (``torch.cuda.set_per_process_memory_fraction``).
    An allocation past it raises ``torch.OutOfMemoryError`` like a full card would.
    """
    if max_memory is None:
        return None
    size = parse_memory_size(max_memory)
    torch_device = resolve_device(device)
    if torch_device.type != "cuda":
        raise InputError(f"--max-memory caps accelerator memory; device '{device}' has none to cap")
    if torch_device.index is None:  # the budget is per device: name the current one
        torch_device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(torch_device)
    warm = torch.ones(64, 64, device=torch_device)
    torch.matmul(warm, warm)  # the context and cuBLAS's handle exist from here on
    torch.cuda.synchronize(torch_device)
    reserved = torch.cuda.memory_reserved(torch_device)
    free, total = torch.cuda.mem_get_info(torch_device)
    process = _process_bytes_on(torch_device)
    outside = (process if process is not None else total - free) - reserved
    allowed = size - max(outside, 0)
    if allowed <= 0:
        raise InputError(
            f"--max-memory {max_memory}: the CUDA context alone holds {outside / 2**30:.2f} GiB on {torch_device}"
        )
    torch.cuda.set_per_process_memory_fraction(min(1.0, allowed / total), torch_device)
    cap = MemoryCap(str(torch_device), size, max(outside, 0), allowed, total)
    logger.info(
        "accelerator memory capped at %.2f GiB on %s: %.2f GiB for tensors, %.2f GiB held by the CUDA context "
        "and libraries (%s)",
        size / 2**30,
        torch_device,
        allowed / 2**30,
        max(outside, 0) / 2**30,
        "this process, NVML" if process is not None else "whole device",
    )
    return cap


def load_adapter(
    model_dir: Path,
    device: str,
    offload: str,
    dtype: torch.dtype,
    chooser: VerifiedChooser | None,
    variant: str | None = None,
    attention: str | None = None,
    memory_budget_bytes: int | None = None,
    kv_cache: str | None = None,
    compile: str | None = None,
) -> PipelineAdapter:
    """An artifact or a plain diffusers directory, through the runtime loader.

    Each quantized layer's kernel path is chosen by ``chooser`` before the repack
    (``ditq.doctor.kernel_chooser``): a path that fails its check is refused and the next one is used, as
    ``ditq generate`` does; None (--skip-doctor) takes the registry's first candidate unverified.
    ``attention`` ("int8" | "fp8" | "int8-fp8"): the transformer's attention through a quantized-attention path
    chosen the same way (``ditq.runtime.attention``); "auto": int8, else int8-fp8, only where it is faster than the
    model's own attention (``ditq.doctor.attention.choose_auto_attention``). The choice is a load fact (/health's ``attention``).
    ``memory_budget_bytes`` (the allocator's cap) is what ``--offload auto`` places the weights within;
    ``kv_cache`` ("int8" | "fp8") keeps the prefix KV cache in 8 bits. The placement, the modules left unused
    and the KV cache's precision are load facts too, and so is ``compile``'s (``ditq.runtime.compile``).
    """
    from ditq.runtime.loader import load_pipeline

    pipeline = load_pipeline(
        model_dir,
        device=device,
        offload=offload,
        dtype=dtype,
        chooser=chooser,
        variant=variant,
        memory_budget_bytes=memory_budget_bytes,
        kv_cache=kv_cache,
        compile=compile,
    )
    adapter = PipelineAdapter(pipeline)
    placement = getattr(pipeline, "ditq_placement", None)
    if (
        placement is not None
    ):  # the object itself: calibration may demote it, and /health shows it as it is then
        adapter.load_facts["placement"] = placement
    adapter.load_facts["unused"] = dict(getattr(pipeline, "ditq_unused", {}))
    adapter.load_facts["kv_cache"] = getattr(pipeline, "ditq_kv_cache", None)
    adapter.load_facts["compile"] = getattr(pipeline, "ditq_compile", None)  # its warm-up is filled in later
    if chooser is not None:  # part of the load time: the doctor's checks, kernel compilation included
        adapter.load_facts["kernel_choice_seconds"] = round(chooser.seconds, 3)
    adapter.load_facts["accumulate"] = chooser.accumulate if chooser is not None else "exact"
    if attention is not None:
        from ditq.doctor.attention import attention_chooser
        from ditq.runtime.attention import install_attention

        verify = chooser is not None
        choose = attention_chooser(attention, torch.device(device), dtype, verify)
        choice = install_attention(pipeline, attention, choose)
        adapter.load_facts["attention"] = choice.summary()
    return adapter


def make_doctor(chooser: VerifiedChooser | None) -> Callable[[PipelineAdapter], DoctorOutcome]:
    """The doctor's start-up outcome: what ``chooser`` chose while the model loaded (``load_adapter`` with the
    same chooser). Every quantized layer runs a path it verified; a geometry without one failed the load."""

    def record(adapter: PipelineAdapter) -> DoctorOutcome:
        if chooser is None:
            return DoctorOutcome("skipped", "--skip-doctor given")
        from ditq.runtime.loader import pipeline_summary

        _, kernels = pipeline_summary(adapter.pipeline)
        summary = chooser.summary(sum(kernels.values()))
        logger.info("kernel doctor: %s", summary)
        return DoctorOutcome("passed", summary)

    return record
