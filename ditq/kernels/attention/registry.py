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

import difflib
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ditq.errors import InputError
from ditq.kernels.attention.reference import ATTENTION_KINDS, QuantizedQK

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

HALF_DTYPES = frozenset({torch.bfloat16, torch.float16})
FLOAT_DTYPES = frozenset({torch.bfloat16, torch.float16, torch.float32})


def _always_available() -> str | None:
    return None


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
    dtypes: frozenset[torch.dtype] = FLOAT_DTYPES
    head_dims: frozenset[int] | None = None  # None: any
    available: Callable[[], str | None] = field(default=_always_available)
    description: str = ""

    def supports(self, device: torch.device | str, dtype: torch.dtype, head_dim: int) -> tuple[bool, str]:
        """(True, "") when this path can run here, else (False, why) in one phrase."""
        device = torch.device(device)
        if device.type != self.device_type:
            return False, f"runs on {self.device_type}, not {device.type}"
        missing = self.available()
        if missing:
            return False, missing
        if self.min_capability is not None:
            capability = torch.cuda.get_device_capability(device)
            if capability < self.min_capability:
                want = ".".join(map(str, self.min_capability))
                return (
                    False,
                    f"needs compute capability >= {want}, device has {capability[0]}.{capability[1]}",
                )
        if dtype not in self.dtypes:
            return False, f"dtype {dtype} not in {sorted(map(str, self.dtypes))}"
        if self.head_dims is not None and head_dim not in self.head_dims:
            return False, f"head dim {head_dim} not in {sorted(self.head_dims)}"
        return True, ""


_REGISTRY: dict[str, AttentionPath] = {}


def register_attention_kernel(
    *,
    name: str,
    kind: str,
    device_type: str,
    priority: int,
    quantize: QuantizeFn,
    min_capability: tuple[int, int] | None = None,
    dtypes: frozenset[torch.dtype] = FLOAT_DTYPES,
    head_dims: frozenset[int] | None = None,
    available: Callable[[], str | None] = _always_available,
    description: str = "",
) -> Callable[[AttendFn], AttendFn]:
    """Decorator: register the decorated ``attend`` as attention path ``name``; returns it unchanged."""
    if kind not in ATTENTION_KINDS:
        raise ValueError(
            f"attention path {name!r}: unknown kind {kind!r} (known: {', '.join(ATTENTION_KINDS)})"
        )

    def decorate(attend: AttendFn) -> AttendFn:
        if name in _REGISTRY:
            raise ValueError(f"attention path {name!r} is registered twice")
        lines = (attend.__doc__ or "").strip().splitlines()
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
            description=description or (lines[0] if lines else ""),
        )
        return attend

    return decorate


def unregister_attention_kernel(name: str) -> None:
    """Remove a path (tests register deliberately broken paths and remove them again)."""
    _REGISTRY.pop(name, None)


def all_attention_kernels() -> list[AttentionPath]:
    """Every registered path, by kind then preference."""
    return sorted(_REGISTRY.values(), key=lambda p: (ATTENTION_KINDS.index(p.kind), -p.priority, p.name))


def _unknown(name: str, where: str) -> InputError:
    close = difflib.get_close_matches(name, list(_REGISTRY), n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return InputError(
        f"{where}: unknown attention path {name!r} (known: {', '.join(sorted(_REGISTRY))}){hint}"
    )


def get_attention_kernel(name: str) -> AttentionPath:
    """The path called ``name``; an unknown name says what it may have meant."""
    if name not in _REGISTRY:
        raise _unknown(name, "attention kernels")
    return _REGISTRY[name]


def _env_names(variable: str) -> list[str]:
    names = [n.strip() for n in os.environ.get(variable, "").split(",") if n.strip()]
    for n in names:
        if n not in _REGISTRY:
            raise _unknown(n, variable)
    return names


def candidate_attention_paths(
    kind: str, device: torch.device | str, dtype: torch.dtype, head_dim: int
) -> list[AttentionPath]:
    """Paths able to run this attention here, most preferred first (the two environment variables honoured)."""
    device = torch.device(device)
    disabled = set(_env_names(ENV_ATTENTION_DISABLE))
    forced = [n for n in _env_names(ENV_ATTENTION_FORCE) if _REGISTRY[n].kind == kind]
    if forced:
        chosen = []
        for n in forced:
            if n in disabled:
                continue
            ok, why = _REGISTRY[n].supports(device, dtype, head_dim)
            if not ok:
                raise InputError(
                    f"{ENV_ATTENTION_FORCE} forces attention path {n!r}, which cannot run here: {why}"
                )
            chosen.append(_REGISTRY[n])
        return chosen
    return [
        p
        for p in all_attention_kernels()
        if p.kind == kind and p.name not in disabled and p.supports(device, dtype, head_dim)[0]
    ]
