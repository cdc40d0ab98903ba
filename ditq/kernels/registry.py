"""One registry of quantized-matmul kernel paths, chosen per layer by scheme, device and shape.

A path is registered by decorating its matmul with ``register_kernel(...)``;
the decorator records the path's requirements (device type, compute
capability, activation dtypes, alignment) and its one-time ``prepare``
(repack after loading). ``candidate_paths`` lists the paths that can run a
layer, most preferred first, honouring two environment variables:

- ``DITQ_KERNELS=a,b``: for a scheme that has a path in the list, only the
  listed paths of that scheme are candidates, in the listed order (a listed
  path that cannot run the layer is an error naming why);
- ``DITQ_DISABLE_KERNELS=a,b``: never offer these paths.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from ditq.errors import InputError
from ditq.schemes import SCHEMES, Scheme

__all__ = [
    "ENV_DISABLE",
    "ENV_FORCE",
    "KernelPath",
    "Prepared",
    "StoredWeight",
    "all_kernels",
    "candidate_paths",
    "get_kernel",
    "register_kernel",
    "unregister_kernel",
]

ENV_FORCE = "DITQ_KERNELS"
ENV_DISABLE = "DITQ_DISABLE_KERNELS"

# Exactly the stored tensors of one Linear, as its scheme's codec lays them out (ditq.checkpoint.codecs).
StoredWeight = Mapping[str, torch.Tensor]
# A path's repacked form; always holds "weight_scale" (post-repack scales, checked finite by the doctor).
Prepared = dict[str, torch.Tensor]
PrepareFn = Callable[[StoredWeight, torch.device], Prepared]
MatmulFn = Callable[[torch.Tensor, Prepared, "torch.Tensor | None"], torch.Tensor]

FLOAT_ACTIVATIONS = frozenset({torch.bfloat16, torch.float16, torch.float32})
HALF_ACTIVATIONS = frozenset({torch.bfloat16, torch.float16})
_SCHEME_ORDER = list(SCHEMES)  # how paths are listed: by scheme, then preference


def _always_available() -> str | None:
    return None


def _first_line(doc: str | None) -> str:
    lines = (doc or "").strip().splitlines()
    return lines[0] if lines else ""


@dataclass(frozen=True)
class KernelPath:
    """One way to compute y = x @ dequant(W)^T + b for a scheme on a kind of device.

    ``matmul(x, prepared, bias)`` takes x (..., K) in bf16/fp16/fp32 and
    returns (..., N) in x.dtype with the bias added; for w8a8/fp8 the
    per-token activation quantization is part of the path.
    ``available()`` returns None or why the path cannot run in this process
    (e.g. Triton missing).
    """

    name: str
    scheme: Scheme  # the preset (``ditq.schemes.SCHEMES``); a path serves every group size of it
    device_type: str
    min_capability: tuple[int, int] | None
    activation_dtypes: frozenset[torch.dtype]
    alignment: int
    priority: int
    prepare: PrepareFn
    matmul: MatmulFn
    available: Callable[[], str | None] = field(default=_always_available)
    description: str = ""

    def supports(
        self,
        device: torch.device,
        activation_dtype: torch.dtype,
        in_features: int,
        out_features: int,
    ) -> tuple[bool, str]:
        """(True, "") when this path can run such a layer here, else (False, why) in one phrase."""
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
        if activation_dtype not in self.activation_dtypes:
            return (
                False,
                f"activation dtype {activation_dtype} not in {sorted(map(str, self.activation_dtypes))}",
            )
        if in_features % self.alignment or out_features % self.alignment:
            return False, f"in/out features {in_features}/{out_features} not multiples of {self.alignment}"
        return True, ""


_REGISTRY: dict[str, KernelPath] = {}


def register_kernel(
    *,
    name: str,
    scheme: Scheme,
    device_type: str,
    prepare: PrepareFn,
    priority: int,
    min_capability: tuple[int, int] | None = None,
    activation_dtypes: frozenset[torch.dtype] = FLOAT_ACTIVATIONS,
    alignment: int = 1,
    available: Callable[[], str | None] = _always_available,
    description: str = "",
) -> Callable[[MatmulFn], MatmulFn]:
    """Decorator: register the decorated matmul as kernel path ``name``; returns the function unchanged."""
    if scheme.name not in SCHEMES:
        raise ValueError(f"kernel {name!r}: unknown scheme {scheme.name!r}")
    preset = SCHEMES[scheme.name]  # the path is chosen by scheme, whatever a layer's group size

    def decorate(matmul: MatmulFn) -> MatmulFn:
        if name in _REGISTRY:
            raise ValueError(f"kernel path {name!r} is registered twice")
        _REGISTRY[name] = KernelPath(
            name=name,
            scheme=preset,
            device_type=device_type,
            min_capability=min_capability,
            activation_dtypes=activation_dtypes,
            alignment=alignment,
            priority=priority,
            prepare=prepare,
            matmul=matmul,
            available=available,
            description=description or _first_line(matmul.__doc__),
        )
        return matmul

    return decorate


def unregister_kernel(name: str) -> None:
    """Remove a path (tests register deliberately broken paths and remove them again)."""
    _REGISTRY.pop(name, None)


def all_kernels() -> list[KernelPath]:
    """Every registered path, by scheme then preference."""
    return sorted(_REGISTRY.values(), key=lambda p: (_SCHEME_ORDER.index(p.scheme.name), -p.priority, p.name))


def get_kernel(name: str) -> KernelPath:
    """The path called ``name``; an unknown name says what it may have meant."""
    if name not in _REGISTRY:
        close = difflib.get_close_matches(name, list(_REGISTRY), n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise InputError(f"unknown kernel path {name!r} (known: {', '.join(sorted(_REGISTRY))}){hint}")
    return _REGISTRY[name]


def _env_names(variable: str) -> list[str]:
    names = [n.strip() for n in os.environ.get(variable, "").split(",") if n.strip()]
    for n in names:
        if n not in _REGISTRY:
            close = difflib.get_close_matches(n, list(_REGISTRY), n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise InputError(f"{variable}: unknown kernel path {n!r}{hint}")
    return names


def candidate_paths(
    scheme: Scheme,
    device: torch.device | str,
    activation_dtype: torch.dtype,
    in_features: int,
    out_features: int,
) -> list[KernelPath]:
    """Paths able to run this layer, most preferred first (env DITQ_KERNELS / DITQ_DISABLE_KERNELS honoured)."""
    device = torch.device(device)
    disabled = set(_env_names(ENV_DISABLE))
    forced = [n for n in _env_names(ENV_FORCE) if _REGISTRY[n].scheme.name == scheme.name]
    if forced:
        chosen = []
        for n in forced:
            if n in disabled:
                continue
            ok, why = _REGISTRY[n].supports(device, activation_dtype, in_features, out_features)
            if not ok:
                raise InputError(f"{ENV_FORCE} forces kernel path {n!r}, which cannot run here: {why}")
            chosen.append(_REGISTRY[n])
        return chosen
    return [
        p
        for p in all_kernels()
        if p.scheme.name == scheme.name
        and p.name not in disabled
        and p.supports(device, activation_dtype, in_features, out_features)[0]
    ]
