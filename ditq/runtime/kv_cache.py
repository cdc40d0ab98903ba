"""An 8-bit prefix KV cache (``--kv-cache int8|fp8``): half the bytes of the reference tokens' keys and values,
which a transformer that attends to a prefix keeps for every later denoising step.

The cache belongs to the model (Qwen-Image-2.1's: ``ditq.runtime.models.qwenimage21.kv_cache``, with the sizes);
here it is asked for by kind. Off by default: its fidelity is measured against the full-precision cache
(``benchmarks/kv_cache_fidelity.py``) before it is relied on.
"""

from __future__ import annotations

from typing import Any

from torch.utils.hooks import RemovableHandle

from ditq.errors import InputError
from ditq.runtime.models import model_family

__all__ = ["KV_CACHE_KINDS", "install_kv_cache"]

KV_CACHE_KINDS = ("int8", "fp8")


def install_kv_cache(pipeline: Any, kind: str) -> RemovableHandle:
    """Every prefix cache the pipeline hands its transformer is filled 8-bit (``kind``: int8 or fp8) from now on;
    returns the hook's handle. A transformer that keeps no such cache is an InputError."""
    if kind not in KV_CACHE_KINDS:
        raise InputError(f"--kv-cache {kind!r}: choose from {', '.join(KV_CACHE_KINDS)}")
    transformer: Any = getattr(pipeline, "transformer", None)
    family = model_family(transformer)
    handle = None if family is None else family.install_kv_cache(transformer, kind)
    if handle is None:
        name = type(transformer).__name__ if transformer is not None else type(pipeline).__name__
        raise InputError(f"--kv-cache {kind}: {name} keeps no prefix KV cache to quantize")
    pipeline.ditq_kv_cache = kind
    return handle
