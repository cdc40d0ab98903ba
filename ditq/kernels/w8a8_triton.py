"""CUDA w8a8 through Triton: per-token int8 activations x per-channel int8 weights, int32 accumulation, scale,
bias and output cast fused (ops ``ditq::w8a8_triton*``; the paths themselves: ``per_token_triton``).
"""

from __future__ import annotations

from ditq.kernels.per_token_triton import register_per_token_triton
from ditq.schemes import W8A8

__all__: list[str] = []

register_per_token_triton(W8A8, priorities=(80, 90, 95), min_capability=(8, 0))
