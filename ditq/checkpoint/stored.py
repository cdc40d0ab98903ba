"""What one quantized Linear stores, and its bytes: its codec's tensors (``ditq.checkpoint.codecs``) and, where it
carries one, its low-rank branch (``ditq.checkpoint.low_rank``). The quantizer writes exactly these tensors, the
runtime and ``ditq save`` check against them, and the planner's size budget counts their bytes: one rule.

A 4-bit layer (out N, in K, groups of 128) stores K*N/2 bytes of packed values, N*(K/128) float32 scales and its
shape (two int64); with a branch of rank R, R*(N+K) bfloat16 more. An 8-bit layer stores K*N bytes and N scales.
"""

from __future__ import annotations

import torch

from ditq.checkpoint.codecs import StoredSpec, codec_for
from ditq.checkpoint.low_rank import branch_rank, low_rank_specs
from ditq.schemes import Scheme

__all__ = ["stored_bytes", "stored_specs"]


def stored_specs(
    scheme: Scheme, out_features: int, in_features: int, low_rank: int = 0
) -> dict[str, StoredSpec]:
    """Local name -> (dtype, shape) of every tensor an (out, in) Linear quantized with ``scheme`` (as fitted to the
    layer: ``Scheme.fitted``) stores, in file order; ``low_rank``: the rank asked for (``branch_rank`` decides
    whether this layer carries it)."""
    specs = codec_for(scheme).specs(out_features, in_features, scheme.group_size)
    return specs | low_rank_specs(out_features, in_features, branch_rank(scheme, low_rank))


def stored_bytes(scheme: Scheme, out_features: int, in_features: int, low_rank: int = 0) -> int:
    """The bytes of ``stored_specs``' tensors: what the layer takes in the artifact (and, but for a kernel's
    repack, in memory)."""
    total = 0
    for dtype, shape in stored_specs(scheme, out_features, in_features, low_rank).values():
        total += torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return total
