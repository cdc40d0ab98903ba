"""One registry of quantized-attention paths, chosen per (kind, device, dtype, head dim).

A path is registered by decorating its ``attend`` with ``register_attention_kernel(...)``, which records the
path's requirements and its ``quantize`` (Q and smoothed K to 8 bits, ``reference`` module's conventions).
``candidate_attention_paths`` lists the paths able to run, most preferred first, honouring two environment
variables (separate from the Linear registry's, whose names they do not share):

- ``DITQ_ATTENTION_KERNELS=a,b``: only the listed paths of the kind, in that order (a listed path that cannot
  run here is an error naming why);
- ``DITQ_DISABLE_ATTENTION_KERNELS=a,b``: never offer these paths.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ditq.errors import InputError
from ditq.kernels.attention.reference import ATTENTION_KINDS, QuantizedQK
from ditq.kernels.registry import (
    FLOAT_ACTIVATIONS,
    always_available,
    did_you_mean,
    first_line,
    honour_env_lists,
    runs_on,
)
from ditq.schemes import Scheme

__all__ = [
    "ENV_ATTENTION_DISABLE",
    "ENV_ATTENTION_FORCE",
    "AttendFn",
    "AttentionPath",
    "QuantizeFn",
    "all_attention_kernels",
    "candidate_attention_paths",
    "get_attention_kernel",
    "register_attention_kernel",
    "unregister_attention_kernel",
]

ENV_ATTENTION_FORCE = "DITQ_ATTENTION_KERNELS"
ENV_ATTENTION_DISABLE = "DITQ_DISABLE_ATTENTION_KERNELS"

# (query (B, S_q, H, D), key (B, S_kv, H, D), kind) -> quantized queries and smoothed keys
QuantizeFn = Callable[[torch.Tensor, torch.Tensor, str], QuantizedQK]
# (quantized Q/K, value (B, S_kv, H, D), key_valid (B, S_kv) bool | None, causal_offset | None, sm_scale)
#   -> (B, S_q, H, D) in value's dtype
AttendFn = Callable[[QuantizedQK, torch.Tensor, "torch.Tensor | None", "int | None", float], torch.Tensor]


@dataclass(frozen=True)
class AttentionPath:
    """One way to compute quantized attention (``reference`` module's arithmetic) for a kind on a device type.

    ``available()`` returns None or why the path cannot run in this process (e.g. Triton missing).
    """

    name: str
    kind: str  # "int8" | "fp8": the dtype of Q . K^T
    device_type: str
    priority: int
    quantize: QuantizeFn
    attend: AttendFn
    min_capability: tuple[int, int] | None = None
    dtypes: frozenset[torch.dtype] = FLOAT_ACTIVATIONS  # of Q, K and V
    head_dims: frozenset[int] | None = None  # None: any
    available: Callable[[], str | None] = field(default=always_available)
    description: str = ""

    def supports(self, device: torch.device | str, dtype: torch.dtype, head_dim: int) -> tuple[bool, str]:
        """(True, "") when this path can run here, else (False, why) in one phrase."""
        ok, why = runs_on(torch.device(device), self.device_type, self.available, self.min_capability)
        if not ok:
            return ok, why
        if dtype not in self.dtypes:
            return False, f"dtype {dtype} not in {sorted(map(str, self.dtypes))}"
        if self.head_dims is not None and head_dim not in self.head_dims:
            return False, f"head dim {head_dim} not in {sorted(self.head_dims)}"
        return True, ""


_REGISTRY: dict[str, AttentionPath] = {}


def register_attention_kernel(
    *,
    name: str,
    kind: str | Scheme,
    device_type: str,
    priority: int,
    quantize: QuantizeFn,
    min_capability: tuple[int, int] | None = None,
    dtypes: frozenset[torch.dtype] = FLOAT_ACTIVATIONS,
    head_dims: frozenset[int] | None = None,
    available: Callable[[], str | None] = always_available,
    description: str = "",
) -> Callable[[AttendFn], AttendFn]:
    """Decorator: register the decorated ``attend`` as attention path ``name``; returns it unchanged.

    ``kind`` is "int8" or "fp8", or a per-token scheme whose activations say it (``W8A8``: int8, ``FP8``: fp8);
    anything else is an InputError in one line."""
    if isinstance(kind, Scheme):
        kind = kind.activations or f"{kind.name} (weight-only)"
    if kind not in ATTENTION_KINDS:
        raise InputError(
            f"attention path {name!r}: unknown kind {kind!r} (known: {', '.join(ATTENTION_KINDS)})"
        )

    def decorate(attend: AttendFn) -> AttendFn:
        if name in _REGISTRY:
            raise ValueError(f"attention path {name!r} is registered twice")
        _REGISTRY[name] = AttentionPath(
            name=name,
            kind=kind,
            device_type=device_type,
            priority=priority,
            quantize=quantize,
            attend=attend,
            min_capability=min_capability,
            dtypes=dtypes,
            head_dims=head_dims,
            available=available,
            description=description or first_line(attend.__doc__),
        )
        return attend

    return decorate


def unregister_attention_kernel(name: str) -> None:
    """Remove a path (tests register deliberately broken paths and remove them again)."""
    _REGISTRY.pop(name, None)


def all_attention_kernels() -> list[AttentionPath]:
    """Every registered path, by kind then preference."""
    return sorted(_REGISTRY.values(), key=lambda p: (ATTENTION_KINDS.index(p.kind), -p.priority, p.name))


def get_attention_kernel(name: str) -> AttentionPath:
    """The path called ``name``; an unknown name says what it may have meant."""
    if name not in _REGISTRY:
        raise InputError(
            f"attention kernels: unknown attention path {name!r} (known: {', '.join(sorted(_REGISTRY))})"
            f"{did_you_mean(name, _REGISTRY)}"
        )
    return _REGISTRY[name]


def candidate_attention_paths(
    kind: str, device: torch.device | str, dtype: torch.dtype, head_dim: int
) -> list[AttentionPath]:
    """Paths able to run this attention here, most preferred first (the two environment variables honoured)."""
    device = torch.device(device)
    ranked = {p.name: p for p in all_attention_kernels() if p.kind == kind}
    return honour_env_lists(
        ranked,
        _REGISTRY,
        ENV_ATTENTION_FORCE,
        ENV_ATTENTION_DISABLE,
        "attention path",
        lambda p: p.supports(device, dtype, head_dim),
    )
