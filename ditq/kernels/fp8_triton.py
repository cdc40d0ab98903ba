"""CUDA fp8 through Triton: per-token e4m3 activations x per-channel e4m3 weights, float32 accumulation, scale,
bias and output cast fused (ops ``ditq::fp8_triton*``; the paths themselves: ``per_token_triton``).
"""

from __future__ import annotations

from ditq.kernels.per_token_triton import register_per_token_triton
from ditq.schemes import FP8

__all__: list[str] = []

register_per_token_triton(FP8, priorities=(60, 70, 75), min_capability=(8, 9))
