"""What the doctor checks a path on: Linear geometries and weight cases (synthetic, analytic, an artifact's own)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ditq.checkpoint.codecs import codec_for
from ditq.kernels.stored import analytic_stored
from ditq.numerics import quantize_weight
from ditq.schemes import Scheme

__all__ = [
    "SEED_GEOMETRIES",
    "CaseMaker",
    "Geometry",
    "WeightCase",
    "analytic_case",
    "default_cases",
    "synthetic_case",
    "synthetic_weights",
]


@dataclass(frozen=True)
class Geometry:
    """One Linear shape: in_features -> out_features."""

    in_features: int
    out_features: int
    label: str = ""
    group_size: int | None = None  # w8a16 grouped scales

    def __str__(self) -> str:
        name = f"{self.in_features}->{self.out_features}"
        if self.group_size:
            name += f" g{self.group_size}"
        return f"{name} ({self.label})" if self.label else name


# The seed's four layer kinds; fused QKV and column share a shape and are checked once.
SEED_GEOMETRIES = (
    Geometry(4096, 12288, "fused QKV / column"),
    Geometry(4096, 4096, "row"),
    Geometry(12288, 4096, "wide-in"),
)


@dataclass(frozen=True)
class WeightCase:
    """Weights for one check: a name ("synthetic", "analytic", "artifact:<layer>") and the stored tensors."""

    name: str
    stored: Mapping[str, torch.Tensor]
    bias: torch.Tensor | None = None
    # For an artifact's own tensors: the file each stored tensor is read from, and their name prefix.
    sources: Mapping[str, Path] | None = None
    prefix: str = ""

    @property
    def analytic(self) -> bool:
        return self.name == "analytic"


# The weight cases of one (scheme, geometry).
CaseMaker = Callable[[Scheme, Geometry], list[WeightCase]]


def synthetic_weights(geometry: Geometry, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The synthetic case's unquantized layer: (weight (out, in), bias (out,)) float32, seeded."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(geometry.out_features, geometry.in_features, generator=generator) * 0.02
    bias = torch.randn(geometry.out_features, generator=generator) * 0.1
    return weight, bias


def synthetic_case(scheme: Scheme, geometry: Geometry, seed: int = 0) -> WeightCase:
    """Random weights quantized by ditq's quantizer, plus a random bias (checkpoint-independent)."""
    weight, bias = synthetic_weights(geometry, seed)
    q, scale = quantize_weight(weight, scheme.with_group_size(geometry.group_size))
    return WeightCase("synthetic", codec_for(scheme).encode(q, scale), bias)


def analytic_case(scheme: Scheme, geometry: Geometry) -> WeightCase:
    """q = qmax, scale = 1/qmax everywhere; with an all-ones input every output equals in_features."""
    return WeightCase("analytic", analytic_stored(scheme, geometry.out_features, geometry.in_features))


def default_cases(weights: Sequence[str]) -> CaseMaker:
    """Weight cases by name: "synthetic" and/or "analytic"."""

    def cases(scheme: Scheme, geometry: Geometry) -> list[WeightCase]:
        out = []
        if "synthetic" in weights:
            out.append(synthetic_case(scheme, geometry))
        if "analytic" in weights:
            out.append(analytic_case(scheme, geometry))
        return out

    return cases
