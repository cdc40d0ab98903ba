"""Modules a pipeline never reads, left out of the loaded model: neither their weights nor their compute.

A ditq artifact's manifest declares them (``unused``: component -> module -> reason, parameters, bytes); the
quantizer declares a text encoder's output head (``lm_head``), whose logits no diffusers pipeline reads (it reads
hidden states). The loader puts an ``UnusedOutput`` in each declared module's place before any weight is read,
so the module's tensors are never loaded and its matmul never runs.

What it returns instead is an ``UnreadTensor``: shaped like the real output, on the meta device, holding nothing.
Anything that computes with it raises an error naming the module and the manifest, so a pipeline that does read
the output fails loudly instead of computing with made-up numbers; only its shape, dtype and device can be asked
for (and ``.to`` is a no-op), which is what output containers and device hooks do with every output.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ditq.errors import DitqError

__all__ = ["UnreadTensor", "UnusedOutput", "drop_unused"]

# What may be asked of an unread output without reading it.
_METADATA = {
    torch.Tensor.shape.__get__,  # type: ignore[attr-defined]
    torch.Tensor.dtype.__get__,  # type: ignore[attr-defined]
    torch.Tensor.device.__get__,
    torch.Tensor.ndim.__get__,  # type: ignore[attr-defined]
    torch.Tensor.is_meta.__get__,  # type: ignore[attr-defined]
    torch.Tensor.size,
    torch.Tensor.dim,
}


class UnreadTensor(torch.Tensor):
    """The output of a module the manifest declares unused: shape, dtype and device only."""

    unread_module: str  # component.module

    @staticmethod
    def make(shape: tuple[int, ...], dtype: torch.dtype, where: str) -> UnreadTensor:
        tensor = torch.Tensor._make_subclass(UnreadTensor, torch.empty(shape, dtype=dtype, device="meta"))
        tensor.unread_module = where
        return tensor

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        if func is torch.Tensor.to:
            return args[0]
        where = next((a.unread_module for a in args if isinstance(a, UnreadTensor)), "an unused module")
        name = getattr(func, "__name__", str(func))
        raise DitqError(
            f"{where} is declared unused in the artifact's MANIFEST.json and was not loaded, but this pipeline reads "
            f"its output ({name}): quantize again with --keep-unused"
        )


class UnusedOutput(torch.nn.Module):
    """Stands in for a Linear the pipeline never reads: no weights; its output is an ``UnreadTensor``."""

    def __init__(self, where: str, out_features: int) -> None:
        super().__init__()
        self.where = where
        self.out_features = out_features

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return UnreadTensor.make(
            (*hidden_states.shape[:-1], self.out_features), hidden_states.dtype, self.where
        )

    def extra_repr(self) -> str:
        return f"{self.where}, out_features={self.out_features}, unused: not loaded"


def drop_unused(model: torch.nn.Module, component: str, modules: Iterable[str]) -> int:
    """Replace each named Linear of ``model`` with an ``UnusedOutput``; returns the bytes of what it held (0 on
    the meta device). A name that is not a Linear of the model is a DitqError: the manifest and model disagree."""
    dropped = 0
    for name in modules:
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise DitqError(
                f"MANIFEST.json: unused {component}.{name} names no module of {type(model).__name__}"
            ) from None
        if not isinstance(module, torch.nn.Linear):
            raise DitqError(
                f"MANIFEST.json: unused {component}.{name} is a {type(module).__name__}, not a Linear"
            )
        dropped += sum(p.numel() * p.element_size() for p in module.parameters() if not p.is_meta)
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, UnusedOutput(f"{component}.{name}", module.out_features))
    return dropped
