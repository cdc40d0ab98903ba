"""One folder per model family: what ditq adds to one transformer architecture (its attention processors, prefill,
fused projections, prefix KV cache, context-parallel plan, step caches), behind the small interface the generic code calls.

The generic code (the loader, ``--compile``, ``--parallel``, ``--attention``, ``--kv-cache``, ``--cache``) asks ``model_family``
for a transformer's family, or for one of its blocks', and never names a model. Adding a model family (Flux, Wan)
is adding a folder beside ``qwenimage21/`` with an object that has ``ModelFamily``'s members, and that object to
``FAMILIES``.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch.utils.hooks import RemovableHandle

from ditq.kernels.attention import AttentionPath
from ditq.runtime.models.qwenimage21 import QWENIMAGE21

__all__ = ["FAMILIES", "ModelFamily", "family_named", "model_family"]


class ModelFamily(Protocol):
    """What the generic code asks of a model family."""

    name: str  # as people write it: "Qwen-Image-2.1"
    transformer_class: str  # diffusers' class name of its transformer
    # its repeated blocks' class names (what ``--compile`` compiles one by one)
    block_classes: tuple[str, ...]
    context_parallel_plan: bool  # whether ``enable_context_parallel`` can split it

    def attention_shape(self, transformer: torch.nn.Module) -> tuple[int, int]:
        """(heads, head dim) of the transformer's attention."""
        ...

    def install_attention(self, transformer: torch.nn.Module, path: AttentionPath) -> None:
        """Every attention module of ``transformer`` runs the quantized-attention ``path`` from now on."""
        ...

    def install_kv_cache(self, transformer: torch.nn.Module, kind: str) -> RemovableHandle | None:
        """The prefix KV cache kept in 8 bits (``kind``) from now on; the hook's handle, or None where this
        transformer keeps no prefix cache."""
        ...

    def fuse_projections(self, module: torch.nn.Module) -> int:
        """Fuse the quantized projections inside ``module`` that read one input (before the repack); how many
        fused Linears were made."""
        ...

    def prepare_compiled_block(self, block: torch.nn.Module) -> None:
        """Ready ``block`` to be compiled as a server compiles it (before torch.compile sees it)."""
        ...

    def compiled_block_arguments(self, block: torch.nn.Module, kwargs: dict[str, Any]) -> None:
        """Rewrite a compiled block's keyword arguments, in place, into what keeps one graph for every call."""
        ...

    def enable_context_parallel(self, transformer: torch.nn.Module, degree: int) -> None:
        """Split ``transformer`` over ``degree`` ranks of the default process group (``--parallel cp=N``)."""
        ...

    def register_cache_blocks(self) -> None:
        """Its repeated blocks made known to diffusers' block registry, which its step caches read (``--cache``)."""
        ...


# transformer class name -> its family
FAMILIES: dict[str, ModelFamily] = {family.transformer_class: family for family in (QWENIMAGE21,)}
_BY_CLASS: dict[str, ModelFamily] = FAMILIES | {
    block: family for family in FAMILIES.values() for block in family.block_classes
}


def family_named(class_name: str) -> ModelFamily | None:
    """The family of the transformer class ``class_name`` (as a ``model_index.json`` names it), or None."""
    return FAMILIES.get(class_name)


def model_family(module: Any) -> ModelFamily | None:
    """The family ``module`` (a transformer, or one of its repeated blocks) belongs to, by its class or a class it
    derives from; None for anything else."""
    for cls in type(module).__mro__:
        family = _BY_CLASS.get(cls.__name__)
        if family is not None:
            return family
    return None
