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
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from ditq.errors import InputError
from ditq.schemes import SCHEMES, Scheme, get_scheme

__all__ = [
    "ACCUMULATE_MODES",
    "ENV_DISABLE",
    "ENV_FORCE",
    "FLOAT_ACTIVATIONS",
    "HALF_ACTIVATIONS",
    "KernelPath",
    "Prepared",
    "StoredWeight",
    "all_kernels",
    "always_available",
    "candidate_paths",
    "did_you_mean",
    "first_line",
    "get_kernel",
    "honour_env_lists",
    "register_kernel",
    "runs_on",
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

# How a path accumulates: "exact" (float32, or int32 for int8: what the reference computes), or "fast" (Hopper's
# fp8 fast accumulation, offered only with --accumulate fast and bounded by the scheme's own error: ditq.doctor.checks)
ACCUMULATE_MODES = ("exact", "fast")

FLOAT_ACTIVATIONS = frozenset({torch.bfloat16, torch.float16, torch.float32})
HALF_ACTIVATIONS = frozenset({torch.bfloat16, torch.float16})
_SCHEME_ORDER = list(SCHEMES)  # how paths are listed: by scheme, then preference


_Path = TypeVar("_Path")


def always_available() -> str | None:
    """The default ``available`` of a path (this registry's and ``ditq.kernels.attention``'s): nothing missing."""
    return None


def first_line(doc: str | None) -> str:
    """A path's default description: the first line of its function's docstring."""
    lines = (doc or "").strip().splitlines()
    return lines[0] if lines else ""


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """ "; did you mean 'x'?" naming the known name closest to ``name``, or "" when none is close."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else ""


def runs_on(
    device: torch.device,
    device_type: str,
    available: Callable[[], str | None],
    min_capability: tuple[int, int] | None,
) -> tuple[bool, str]:
    """The device half of a path's ``supports``: (True, "") when a path with these requirements can run on
    ``device`` in this process, else (False, why) in one phrase."""
    if device.type != device_type:
        return False, f"runs on {device_type}, not {device.type}"
    missing = available()
    if missing:
        return False, missing
    if min_capability is not None:
        capability = torch.cuda.get_device_capability(device)
        if capability < min_capability:
            want = ".".join(map(str, min_capability))
            return False, f"needs compute capability >= {want}, device has {capability[0]}.{capability[1]}"
    return True, ""


def _env_names(variable: str, known: Collection[str], what: str) -> list[str]:
    names = [n.strip() for n in os.environ.get(variable, "").split(",") if n.strip()]
    for n in names:
        if n not in known:
            raise InputError(
                f"{variable}: unknown {what} {n!r} (known: {', '.join(sorted(known))}){did_you_mean(n, known)}"
            )
    return names


def honour_env_lists(
    ranked: Mapping[str, _Path],
    known: Collection[str],
    force_variable: str,
    disable_variable: str,
    what: str,
    supports: Callable[[_Path], tuple[bool, str]],
) -> list[_Path]:
    """The paths of ``ranked`` (one kind's, by name, most preferred first) that ``supports`` says can run, with
    two comma-separated lists of ``known`` names read from the environment: ``disable_variable``'s are never
    offered; when ``force_variable`` lists paths of this kind, only those are, in its order (one that cannot run
    is an InputError naming why). An unknown name in either is an InputError that says what it may have meant."""
    disabled = set(_env_names(disable_variable, known, what))
    forced = [n for n in _env_names(force_variable, known, what) if n in ranked]
    if forced:
        chosen = []
        for n in forced:
            if n in disabled:
                continue
            ok, why = supports(ranked[n])
            if not ok:
                raise InputError(f"{force_variable} forces {what} {n!r}, which cannot run here: {why}")
            chosen.append(ranked[n])
        return chosen
    return [p for n, p in ranked.items() if n not in disabled and supports(p)[0]]


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
    available: Callable[[], str | None] = field(default=always_available)
    description: str = ""
    accumulate: str = "exact"  # one of ACCUMULATE_MODES
    # Tokens (rows of x) from which the matmul runs other code than below them (None: one code for every count), or
    # that count as a function of the layer's (in_features, out_features) (None: none at that geometry): the doctor
    # checks such a path on each side (``rows_checked``)
    split_rows: int | Callable[[int, int], int | None] | None = None

    def split_at(self, in_features: int, out_features: int) -> int | None:
        """The token count from which this path runs its other code at a layer of this shape, or None."""
        split = self.split_rows
        return split(in_features, out_features) if callable(split) else split

    def rows_checked(self, rows: int, in_features: int, out_features: int) -> tuple[int, ...]:
        """The token counts the doctor checks this path at when asked for ``rows`` at a layer of this shape:
        ``rows``, and for a path that splits there, a count on the other side of the split too."""
        split = self.split_at(in_features, out_features)
        if split is None or split <= 1:
            return (rows,)
        return (rows, split) if rows < split else (split - 1, rows)

    def supports(
        self,
        device: torch.device,
        activation_dtype: torch.dtype,
        in_features: int,
        out_features: int,
    ) -> tuple[bool, str]:
        """(True, "") when this path can run such a layer here, else (False, why) in one phrase."""
        ok, why = runs_on(torch.device(device), self.device_type, self.available, self.min_capability)
        if not ok:
            return ok, why
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
    scheme: Scheme | str,
    device_type: str,
    prepare: PrepareFn,
    priority: int = 0,
    min_capability: tuple[int, int] | None = None,
    activation_dtypes: frozenset[torch.dtype] = FLOAT_ACTIVATIONS,
    alignment: int = 1,
    available: Callable[[], str | None] = always_available,
    description: str = "",
    accumulate: str = "exact",
    split_rows: int | Callable[[int, int], int | None] | None = None,
) -> Callable[[MatmulFn], MatmulFn]:
    """Decorator: register the decorated matmul as kernel path ``name``; returns the function unchanged.

    ``scheme`` is a ``Scheme`` or its name or alias ("w8a16", "int8dq"...); anything else is an InputError in one
    line. Higher ``priority`` is preferred. ``accumulate`` ("exact" | "fast") says how it accumulates: a fast path
    is a candidate only where fast accumulation was asked for (``candidate_paths``). ``split_rows``: the token count
    from which the matmul runs other code, or a function of (in_features, out_features) giving it (None: not at
    that shape); the doctor then checks both sides."""
    preset = _scheme_of(scheme, f"kernel path {name!r}")  # chosen by scheme, whatever a layer's group size
    if accumulate not in ACCUMULATE_MODES:
        raise InputError(
            f"kernel path {name!r}: accumulate {accumulate!r} is not one of {', '.join(ACCUMULATE_MODES)}"
        )

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
            description=description or first_line(matmul.__doc__),
            accumulate=accumulate,
            split_rows=split_rows,
        )
        return matmul

    return decorate


def _scheme_of(scheme: object, where: str) -> Scheme:
    """The registered preset for a Scheme or a scheme name."""
    if isinstance(scheme, str):
        return get_scheme(scheme)
    if isinstance(scheme, Scheme) and scheme.name in SCHEMES:
        return SCHEMES[scheme.name]
    raise InputError(f"{where}: scheme must be one of {', '.join(SCHEMES)} or a ditq Scheme, got {scheme!r}")


def unregister_kernel(name: str) -> None:
    """Remove a path (tests register deliberately broken paths and remove them again)."""
    _REGISTRY.pop(name, None)


def all_kernels() -> list[KernelPath]:
    """Every registered path, by scheme then preference."""
    return sorted(_REGISTRY.values(), key=lambda p: (_SCHEME_ORDER.index(p.scheme.name), -p.priority, p.name))


def get_kernel(name: str) -> KernelPath:
    """The path called ``name``; an unknown name says what it may have meant."""
    if name not in _REGISTRY:
        raise InputError(
            f"unknown kernel path {name!r} (known: {', '.join(sorted(_REGISTRY))}){did_you_mean(name, _REGISTRY)}"
        )
    return _REGISTRY[name]


def candidate_paths(
    scheme: Scheme,
    device: torch.device | str,
    activation_dtype: torch.dtype,
    in_features: int,
    out_features: int,
    accumulate: str = "exact",
) -> list[KernelPath]:
    """Paths able to run this layer, most preferred first (env DITQ_KERNELS / DITQ_DISABLE_KERNELS honoured);
    fast-accumulating paths only where ``accumulate`` is "fast"."""
    if accumulate not in ACCUMULATE_MODES:
        raise InputError(f"--accumulate {accumulate!r}: choose from {', '.join(ACCUMULATE_MODES)}")
    device = torch.device(device)
    ranked = {
        p.name: p
        for p in all_kernels()
        if p.scheme.name == scheme.name and (p.accumulate == "exact" or accumulate == "fast")
    }
    return honour_env_lists(
        ranked,
        _REGISTRY,
        ENV_FORCE,
        ENV_DISABLE,
        "kernel path",
        lambda p: p.supports(device, activation_dtype, in_features, out_features),
    )
