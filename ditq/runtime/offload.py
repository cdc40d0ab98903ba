"""Where a loaded pipeline's weights live while it runs: all on the device, one component at a time, per block,
or placed by how often each component runs.

- ``none``: every component on the device.
- ``model``: components wait on the host and move to the device whole, one at
  a time, when they run (diffusers' ``enable_model_cpu_offload``, through accelerate).
- ``block``: every component's blocks stream to the device one by one around their forward, from pinned host
  memory (a ``Placement`` with nothing resident), for models whose denoiser alone does not fit.
- ``auto``: a ``Placement``. Components are ranked by how often a request runs them: the denoiser (transformer
  or UNet: every step) first, then the VAE (once per reference and once to decode), then the rest (text
  encoders: once per request), smallest first. The longest prefix of that ranking whose weights fit the budget
  stays resident; each other component streams its blocks from pinned host memory on a side stream as it runs
  (diffusers' group offload with ``use_stream``; ``block_modules`` reaches block lists nested inside a text
  encoder). ``Placement.demote`` takes the next step when a measured request does not fit: the VAE decodes in
  tiles, then the resident components start to stream from the last one up; streaming the denoiser too (block
  offload) is the last resort.

Quantized layers must be repacked before offload hooks are attached, so the
hooks see the final set of tensors (``ditq.runtime.loader.prepare_quantized``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ditq.devices import OFFLOAD_MODES
from ditq.errors import DitqError

__all__ = ["DENOISERS", "Placement", "apply_offload", "module_bytes", "run_order", "transfer_rate_gbps"]

log = logging.getLogger(__name__)

DENOISERS = ("transformer", "unet", "transformer_2", "prior")  # the components a request runs at every step
_TRANSFER_PROBE_BYTES = 256 * 2**20


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers (what moving it moves)."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors if not t.is_meta)


def _modules(pipeline: Any) -> dict[str, torch.nn.Module]:
    return {
        name: c
        for name, c in pipeline.components.items()
        if isinstance(c, torch.nn.Module) and module_bytes(c) > 0
    }


def run_order(pipeline: Any) -> list[str]:
    """The pipeline's weighted components, the most often run first: denoisers, the VAE, then the rest by size."""
    modules = _modules(pipeline)
    first = [n for n in DENOISERS if n in modules]
    vae = [n for n in ("vae",) if n in modules]
    rest = sorted(
        (n for n in modules if n not in first and n not in vae), key=lambda n: module_bytes(modules[n])
    )
    return first + vae + rest


def transfer_rate_gbps(device: torch.device) -> float | None:
    """Pinned host -> ``device`` copy rate, GB/s (one 256 MiB copy after a warm-up); None off CUDA."""
    if device.type != "cuda":
        return None
    host = torch.empty(_TRANSFER_PROBE_BYTES, dtype=torch.uint8, pin_memory=True)
    target = torch.empty_like(host, device=device)
    target.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    started = time.perf_counter()
    target.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    del host, target
    return round(_TRANSFER_PROBE_BYTES / seconds / 1e9, 2)


def _nested_block_modules(module: torch.nn.Module) -> list[str]:
    """The child names on the way to every block list below ``module`` (``model``, ``language_model`` for a
    Qwen3-VL text encoder), which diffusers' block-level group offload descends into."""
    from ditq.targets import block_lists

    names: set[str] = set()
    for path in block_lists(module):
        names.update(path.split(".")[:-1])
    return sorted(names)


def _stream(component: torch.nn.Module, device: torch.device) -> None:
    """Blocks of ``component`` from pinned host memory to ``device`` around their forward, the next one copied on a
    side stream while the current one runs (on the CPU: the same hooks, nothing to copy)."""
    from diffusers.hooks import apply_group_offloading

    component.to("cpu")
    cuda = device.type == "cuda"
    apply_group_offloading(
        component,
        onload_device=device,
        offload_device=torch.device("cpu"),
        offload_type="block_level",
        num_blocks_per_group=1,
        use_stream=cuda,
        non_blocking=cuda,
        low_cpu_mem_usage=False,  # pinned copies made once, not per transfer
        block_modules=_nested_block_modules(component) or None,
        exclude_kwargs=getattr(component, "_skip_keys", None),
    )


@dataclass
class Placement:
    """``auto`` offload: which components stay on the device, which stream, and whether the VAE decodes in tiles."""

    device: torch.device
    order: list[str]  # run_order
    sizes: dict[str, int]  # component -> bytes
    budget_bytes: int | None  # what the weights may take on the device (None: the device's free memory)
    resident: list[str] = field(default_factory=list)
    streamed: list[str] = field(default_factory=list)
    vae_tiling: bool = False
    transfer_gbps: float | None = None
    steps: list[str] = field(default_factory=list)  # what each demotion did, in order

    @classmethod
    def fit(cls, pipeline: Any, device: torch.device, budget_bytes: int | None) -> Placement:
        """The longest prefix of the run order whose weights fit ``budget_bytes`` resident (at least the first
        component), the rest streamed; applied to ``pipeline``."""
        order = run_order(pipeline)
        modules = _modules(pipeline)
        sizes = {n: module_bytes(modules[n]) for n in order}
        if budget_bytes is None and device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(device)
            budget_bytes = int(free)
        placement = cls(device, order, sizes, budget_bytes)
        total = 0
        for name in order:
            total += sizes[name]
            if budget_bytes is not None and total > budget_bytes and placement.resident:
                break
            placement.resident.append(name)
        if (
            budget_bytes is not None and order and sizes[order[0]] > budget_bytes
        ):  # not even the denoiser fits
            placement.resident = []
        placement.streamed = [n for n in order if n not in placement.resident]
        for name in placement.resident:
            modules[name].to(device)
        for name in placement.streamed:
            _stream(modules[name], device)
        if placement.streamed:
            placement.transfer_gbps = transfer_rate_gbps(device)
        log.info("placement on %s: %s", device, placement.summary())
        return placement

    def demote(self, pipeline: Any) -> str | None:
        """One step toward less device memory (VAE tiling, then the last resident component streamed); what it
        did, or None when nothing is left to move."""
        vae = getattr(pipeline, "vae", None)
        if not self.vae_tiling and vae is not None and callable(getattr(vae, "enable_tiling", None)):
            vae.enable_tiling()
            self.vae_tiling = True
            step = "the VAE decodes in tiles"
        elif self.resident:
            name = self.resident.pop()
            module = _modules(pipeline)[name]
            _stream(module, self.device)
            self.streamed.insert(0, name)
            if self.transfer_gbps is None:
                self.transfer_gbps = transfer_rate_gbps(self.device)
            step = f"{name} streams from pinned host memory"
        else:
            return None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.steps.append(step)
        log.info("placement on %s: %s; now %s", self.device, step, self.summary())
        return step

    def summary(self) -> str:
        resident = ", ".join(self.resident) or "nothing"
        streamed = ", ".join(self.streamed) or "nothing"
        tiling = "; VAE tiling" if self.vae_tiling else ""
        return f"resident {resident}; streamed {streamed}{tiling}"

    def to_json(self) -> dict[str, Any]:
        return {
            "resident": list(self.resident),
            "streamed": list(self.streamed),
            "vae_tiling": self.vae_tiling,
            "sizes_bytes": dict(self.sizes),
            "budget_bytes": self.budget_bytes,
            "transfer_gbps": self.transfer_gbps,
            "demotions": list(self.steps),
        }


def apply_offload(pipeline: Any, mode: str, device: torch.device, budget_bytes: int | None = None) -> None:
    """Place ``pipeline`` on ``device`` per ``mode``; ``auto`` sets ``pipeline.ditq_placement`` (``budget_bytes``:
    what its weights may take there, default the device's free memory)."""
    if mode == "none":
        pipeline.to(device)
    elif mode == "auto":
        pipeline.ditq_placement = Placement.fit(pipeline, device, budget_bytes)
    elif mode == "model":
        try:
            import accelerate  # noqa: F401
        except ImportError as error:
            raise DitqError("offload 'model' needs accelerate (pip install accelerate)") from error
        if getattr(pipeline, "model_cpu_offload_seq", None) is None:
            # A pipeline without a declared order offloads its modules in model_index order.
            modules = [n for n, c in pipeline.components.items() if isinstance(c, torch.nn.Module)]
            pipeline.model_cpu_offload_seq = "->".join(modules)
        pipeline.enable_model_cpu_offload(device=device)
    elif mode == "block":  # every component streams, the denoiser included
        pipeline.ditq_placement = Placement.fit(pipeline, device, budget_bytes=0)
    else:
        raise DitqError(f"unknown offload mode {mode!r} (known: {', '.join(OFFLOAD_MODES)})")
