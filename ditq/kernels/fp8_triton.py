"""CUDA fp8 through Triton: per-token e4m3 activations x per-channel e4m3 weights, float32 accumulation, scale,
bias and output cast fused (ops ``ditq::fp8_triton*``; the paths themselves: ``per_token_triton``).
"""

from __future__ import annotations

import torch

from ditq.kernels.per_token_triton import register_per_token_triton
from ditq.kernels.registry import Prepared, StoredWeight
from ditq.kernels.stored import stored_fp8_weight

__all__: list[str] = []


def _prepare(stored: StoredWeight, device: torch.device) -> Prepared:
    """weight float8_e4m3fn (N, K) as stored (K contiguous); weight_scale (N,) float32."""
    q, scale = stored_fp8_weight(stored)
    return {
        "weight": q.to(device).contiguous(),
        "weight_scale": scale.to(device, torch.float32).reshape(-1).contiguous(),
    }


register_per_token_triton("fp8", "fp8", _prepare, priorities=(60, 70, 75), min_capability=(8, 9))
