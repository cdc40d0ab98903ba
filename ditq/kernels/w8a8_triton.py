"""CUDA w8a8 through Triton: per-token int8 activations x per-channel int8 weights, int32 accumulation, scale,
bias and output cast fused (ops ``ditq::w8a8_triton*``; the paths themselves: ``per_token_triton``).
"""

from __future__ import annotations

import torch

from ditq.kernels.per_token_triton import register_per_token_triton
from ditq.kernels.registry import Prepared, StoredWeight
from ditq.kernels.stored import stored_int8_weight

__all__ = ["prepare_w8a8"]


def prepare_w8a8(stored: StoredWeight, device: torch.device) -> Prepared:
    """weight int8 (N, K) as stored (K contiguous); weight_scale (N,) float32."""
    q, scale = stored_int8_weight(stored)
    return {
        "weight": q.to(device).contiguous(),
        "weight_scale": scale.to(device, torch.float32).reshape(-1).contiguous(),
    }


register_per_token_triton("w8a8", "int8", prepare_w8a8, priorities=(80, 90, 95), min_capability=(8, 0))
