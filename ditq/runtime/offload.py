"""Where a loaded pipeline's weights live while it runs: all on the device, one component at a time, or one block.

- ``none``: every component on the device.
- ``model``: components wait on the host and move to the device whole, one at
  a time, when they run (diffusers' ``enable_model_cpu_offload``, through accelerate).
- ``block``: components' blocks stream to the device one by one around their
  forward (diffusers' block-level group offload), for models that do not fit.

Quantized layers must be repacked before offload hooks are attached, so the
hooks see the final set of tensors (``ditq.runtime.loader.prepare_quantized``).
"""

from __future__ import annotations

from typing import Any

import torch

from ditq.devices import OFFLOAD_MODES
from ditq.errors import DitqError

__all__ = ["apply_offload"]


def apply_offload(pipeline: Any, mode: str, device: torch.device) -> None:
    host = torch.device("cpu")
    if mode == "none":
        pipeline.to(device)
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
    elif mode == "block":
        pipeline.enable_group_offload(
            onload_device=device, offload_device=host, offload_type="block_level", num_blocks_per_group=1
        )
    else:
        raise DitqError(f"unknown offload mode {mode!r} (known: {', '.join(OFFLOAD_MODES)})")
