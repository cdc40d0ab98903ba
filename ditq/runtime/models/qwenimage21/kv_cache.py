"""An 8-bit prefix KV cache for Qwen-Image-2.1 (``--kv-cache int8|fp8``): half the bytes of the reference tokens'
keys and values, which the transformer keeps for every later denoising step.

Under ``causal_condition`` the transformer computes the keys and values of the text and the reference images once
(the first step, ``kv_cache_mode="extract"``) and reads them back at every later step. diffusers'
``QwenImage21KVLayerCache`` stores them as they are: at 1024x1024 with four references that is 32 blocks x K and V
x 16 384 tokens x 3072 x 2 bytes, about 6.4 GB. ``QuantizedKVLayerCache`` stores each (token, head) row of
``head_dim`` values in 8 bits with its own float32 scale (``ditq.numerics.quantize_activation_per_token``: int8
symmetric or float8_e4m3fn), and dequantizes one block's keys and values to the compute dtype when that block
reads them. Off by default: its fidelity is measured against the full-precision cache
(``benchmarks/kv_cache_fidelity.py``) before it is relied on.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache, QwenImage21KVLayerCache
from torch.utils.hooks import RemovableHandle

from ditq.numerics import quantize_activation_per_token

__all__ = ["QuantizedKVLayerCache", "install_kv_cache"]


class QuantizedKVLayerCache(QwenImage21KVLayerCache):
    """One block's prefix keys and values, stored 8-bit per (token, head) row: (B, S, H, D) int8|fp8 + (B, S, H, 1)
    float32 scales."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self._stored: tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = (
            None
        )
        self._dtype: torch.dtype | None = None

    def store(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self._dtype = k.dtype
        self._stored = (
            quantize_activation_per_token(k, self.kind),
            quantize_activation_per_token(v, self.kind),
        )

    def get(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._stored is None or self._dtype is None:
            raise RuntimeError("KV cache has not been populated yet.")
        (k, k_scale), (v, v_scale) = self._stored
        dtype = self._dtype
        return (k.to(torch.float32) * k_scale).to(dtype), (v.to(torch.float32) * v_scale).to(dtype)

    def nbytes(self) -> int:
        if self._stored is None:
            return 0
        return sum(t.numel() * t.element_size() for pair in self._stored for t in pair)


def install_kv_cache(transformer: torch.nn.Module, kind: str) -> RemovableHandle | None:
    """Every prefix cache ``transformer`` is handed is filled 8-bit (``kind``: int8 or fp8) from now on; returns
    the hook's handle, or None where the transformer keeps no prefix cache (it was built without
    ``causal_condition``)."""
    if not getattr(getattr(transformer, "config", None), "causal_condition", False):
        return None

    def quantize_on_extract(_module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        cache = kwargs.get("kv_cache")
        if kwargs.get("kv_cache_mode") == "extract" and isinstance(cache, QwenImage21KVCache):
            cache.layer_caches = [QuantizedKVLayerCache(kind) for _ in cache.layer_caches]

    return transformer.register_forward_pre_hook(quantize_on_extract, with_kwargs=True)
