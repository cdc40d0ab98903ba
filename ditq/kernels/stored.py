"""Stored weights to exercise kernel paths with (the doctor, the kernel tests, the benchmarks).

Kernel paths name their scheme (``KernelPath.scheme``), so these take a scheme name; the tensors are
laid out by the scheme's codec (``ditq.checkpoint.codecs``), exactly as a checkpoint stores them.
"""

from __future__ import annotations

import torch

from ditq.checkpoint.codecs import codec_for
from ditq.schemes import SCHEMES

__all__ = ["analytic_stored", "stored_from_quantized"]


def stored_from_quantized(q: torch.Tensor, scale: torch.Tensor, scheme_name: str) -> dict[str, torch.Tensor]:
    """(q (out, in), scale (out, 1|groups)) -> the tensors a checkpoint stores for one Linear under ``scheme_name``."""
    return codec_for(SCHEMES[scheme_name]).encode(q, scale)


def analytic_stored(scheme_name: str, out_features: int, in_features: int) -> dict[str, torch.Tensor]:
    """Every q = qmax, scale = 1/qmax (127 for int8; 448, e4m3's largest, for fp8): W is all ones.

    With an all-ones input every output equals ``in_features`` (exactly, up to the output dtype's rounding).
    """
    scheme = SCHEMES[scheme_name]
    q = torch.full((out_features, in_features), scheme.weight_qmax).to(scheme.weight_dtype)
    scale = torch.full((out_features, 1), 1.0 / scheme.weight_qmax, dtype=torch.float32)
    return stored_from_quantized(q, scale, scheme_name)
