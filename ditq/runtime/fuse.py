"""Fused projections: quantized Linears that read the same input become one GEMM at load (``fuse=True``).

Which Linears read one input is the model's to say (Qwen-Image-2.1's: ``ditq.runtime.models.qwenimage21.fuse``,
where the measurements are); stacking them is generic (``ditq.runtime.modules.fuse_linears``: exact per output
channel). The checkpoint is untouched; only the loaded module fuses them, before the repack.
"""

from __future__ import annotations

import logging

import torch

from ditq.runtime.models import model_family
from ditq.runtime.modules import stored_layer_count

__all__ = ["fuse_projections", "stored_layer_count"]

log = logging.getLogger(__name__)


def fuse_projections(module: torch.nn.Module) -> int:
    """Fuse every fusable projection group inside ``module`` (a pipeline component, before its quantized layers
    are repacked) where its model family knows them; returns how many fused Linears were made (0 for a module of
    no known family)."""
    family = model_family(module)
    fused = 0 if family is None else family.fuse_projections(module)
    if fused:
        log.info("%s: %d fused projections (query/key/value, gate/up)", type(module).__name__, fused)
    return fused
