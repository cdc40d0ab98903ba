"""A transformer's prefix KV caches are let go when the VAE starts decoding, not when the pipeline call returns.

A pipeline that keeps a prefix KV cache (Qwen-Image-2.1 under ``causal_condition``: the keys and values of the
text and reference tokens, filled at the first step and read at every later one) holds it in a local variable
of its ``__call__``, so it stays allocated through the VAE decode. At 1024x1024 with four references that is
about 8 GiB held while the decode takes its own 6 GiB. Once decoding has begun the denoising loop is over and
nothing reads the cache again, so emptying it then changes no pixel and takes its bytes off the decode's peak.

The mechanism is the transformer's own call convention, not a pipeline class: for the length of one call,
every ``kv_cache`` argument the transformer is handed whose ``layer_caches`` list holds per-block caches is
remembered, and ``vae.decode`` is shadowed so that its first call replaces each of those per-block caches
with a released one. A pipeline that reads a released cache gets a RuntimeError that says so, never numbers
from nothing. Pipelines without such an argument, or without ``vae.decode``, are untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ditq.runtime.stage_clock import shadowed

__all__ = ["ReleasedLayerCache", "released_at_decode"]


class ReleasedLayerCache:
    """Stands where a block's prefix cache was: reading it is an error, storing into it fills it again."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def store(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k, v

    def get(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k is None or self.v is None:
            raise RuntimeError("the prefix KV cache was released when the VAE began decoding")
        return self.k, self.v


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_tensor_bytes(item) for item in value)
    return 0


class _Release:
    """The caches one call handed its transformer, and what releasing them freed."""

    def __init__(self) -> None:
        self.caches: list[Any] = []
        self.released_bytes = 0

    def remember(self, _module: torch.nn.Module, _args: Any, kwargs: dict[str, Any]) -> None:
        cache = kwargs.get("kv_cache")
        layers = getattr(cache, "layer_caches", None)
        if isinstance(layers, list) and layers and all(c is not cache for c in self.caches):
            self.caches.append(cache)

    def release(self) -> None:
        for cache in self.caches:
            self.released_bytes += sum(
                _tensor_bytes(list(vars(layer).values())) for layer in cache.layer_caches
            )
            cache.layer_caches = [ReleasedLayerCache() for _ in cache.layer_caches]
        self.caches = []

    def decoding(self, decode: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.release()
            return decode(*args, **kwargs)

        return wrapper


@contextmanager
def released_at_decode(pipeline: Any) -> Iterator[_Release]:
    """For the length of the block (one pipeline call), the prefix caches handed to ``pipeline.transformer`` are
    released when ``pipeline.vae.decode`` is first called; yields the record (``released_bytes``)."""
    record = _Release()
    transformer = getattr(pipeline, "transformer", None)
    vae = getattr(pipeline, "vae", None)
    if (
        vae is None
        or not isinstance(transformer, torch.nn.Module)
        or not callable(getattr(vae, "decode", None))
    ):
        yield record
        return
    handle = transformer.register_forward_pre_hook(record.remember, with_kwargs=True)
    try:
        with shadowed(vae, "decode", record.decoding(vae.decode)):
            yield record
    finally:
        handle.remove()
