"""Stored weights to exercise kernel paths with (the doctor, the kernel tests, the benchmarks).

The tensors are laid out by the scheme's codec (``ditq.checkpoint.codecs``), exactly as a checkpoint stores
them; random weights go through ``codec_for(scheme).encode(*quantize_weight(weight, scheme))``.
"""

from __future__ import annotations

import torch

from ditq.checkpoint.codecs import codec_for
from ditq.schemes import Scheme

__all__ = ["analytic_stored"]


def analytic_stored(scheme: Scheme, out_features: int, in_features: int) -> dict[str, torch.Tensor]:
    """Every q = qmax, scale = 1/qmax (127 for int8; 448, e4m3's largest, for fp8): W is all ones.

    With an all-ones input every output equals ``in_features`` (exactly, up to the output dtype's rounding).
    """
    q = torch.full((out_features, in_features), scheme.weight_qmax).to(scheme.weight_dtype)
    scale = torch.full((out_features, 1), 1.0 / scheme.weight_qmax, dtype=torch.float32)
    return codec_for(scheme).encode(q, scale)
