"""Quantized attention on a loaded pipeline (``--attention int8|fp8|int8-fp8|fp8-fp8|auto``): the doctor chooses
the path, the runtime installs it.

``install_attention`` reads the transformer's attention shape from its model family, asks ``choose`` (the doctor's
``ditq.doctor.attention.attention_chooser``, which checks the candidate paths against float32 and, for ``auto``,
times them) for a decision, and installs the chosen path through the family's processor (Qwen-Image-2.1's:
``ditq.runtime.models.qwenimage21.attention``). As with Linear kernels (``prepare_quantized(chooser=...)``), the
chooser never touches the model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from ditq.errors import InputError
from ditq.kernels.attention import AttentionPath
from ditq.runtime.models import FAMILIES, model_family

__all__ = ["AttentionDecision", "install_attention"]


class AttentionDecision(Protocol):
    """What a chooser decided: the path to install (None: the model keeps its own attention), said in a line."""

    @property
    def path(self) -> AttentionPath | None: ...

    def summary(self) -> str: ...


Decision = TypeVar("Decision", bound=AttentionDecision)


def install_attention(pipeline: Any, kind: str, choose: Callable[[int, int], Decision]) -> Decision:
    """Install ``choose(heads, head_dim)``'s path on every attention module of the pipeline's transformer; returns
    the decision. ``kind`` (the ``--attention`` value) names the option where the transformer is of no family that
    has a quantized-attention processor."""
    transformer: Any = getattr(pipeline, "transformer", None)
    family = model_family(transformer)
    if family is None:
        known = ", ".join(f"{f.name} ({f.transformer_class})" for f in FAMILIES.values())
        raise InputError(
            f"--attention {kind}: quantized attention supports {known} transformers; this pipeline's transformer "
            f"is {type(transformer).__name__}",
            field="attention",
        )
    heads, head_dim = family.attention_shape(transformer)
    decision = choose(heads, head_dim)
    if decision.path is not None:
        family.install_attention(transformer, decision.path)
    return decision
