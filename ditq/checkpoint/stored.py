"""The tensors stored per quantized Linear, per scheme: their specs, the encoder (row bands) and ditq's decoder.

| scheme | tensors (``<prefix>.`` + name)                                                     |
| w8a16  | weight_packed int32 (out, in/4), weight_scale f32 (out, 1 or in/g), weight_shape int64 (2,) |
| w8a8   | weight int8 (out, in), weight_scale f32 (out, 1)                                   |
| fp8    | weight float8_e4m3fn (out, in), weight_scale f32 (out, 1)                          |

Quantization is per output row (channel or groups within a row), so a
weight can be encoded one band of rows at a time with the same result as all
at once. The arithmetic is ``ditq.numerics``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ditq.numerics import dequantize_weight, pack_int8_to_int32, quantize_weight, unpack_int32_to_int8
from ditq.schemes import Scheme

__all__ = ["EncodedBand", "decode_stored", "encode_band", "stored_specs"]


def stored_specs(
    scheme: Scheme, out_features: int, in_features: int
) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Local tensor name -> (dtype, shape) of one quantized Linear's stored tensors."""
    groups = 1 if scheme.group_size is None else in_features // scheme.group_size
    scale = (torch.float32, (out_features, groups))
    if scheme.format == "pack-quantized":
        return {
            "weight_packed": (torch.int32, (out_features, in_features // 4)),
            "weight_scale": scale,
            "weight_shape": (torch.int64, (2,)),
        }
    return {"weight": (scheme.weight_dtype, (out_features, in_features)), "weight_scale": scale}


@dataclass
class EncodedBand:
    """One band of rows: the stored weight rows, their scales, and the squared error terms of the band."""

    stored_rows: torch.Tensor  # (rows, in) int8/fp8, or (rows, in/4) int32 packed
    scale: torch.Tensor  # (rows, groups) float32
    error_sq: float  # sum (w - dequantized)^2 over the band
    reference_sq: float  # sum w^2 over the band


def encode_band(weight_rows: torch.Tensor, scheme: Scheme) -> EncodedBand:
    """Quantize a (rows, in) band of a weight; stored rows and scales come back on the CPU."""
    q, scale = quantize_weight(weight_rows, scheme)
    reference = weight_rows.to(torch.float32)
    error = dequantize_weight(q, scale).sub_(reference)
    # float32 sums over one band (torch reduces in blocks); bands are summed in float64 by the caller.
    error_sq = float(torch.linalg.vector_norm(error)) ** 2
    reference_sq = float(torch.linalg.vector_norm(reference)) ** 2
    stored = pack_int8_to_int32(q) if scheme.format == "pack-quantized" else q
    return EncodedBand(stored.cpu(), scale.cpu(), error_sq, reference_sq)


def decode_stored(stored: Mapping[str, torch.Tensor], scheme: Scheme) -> torch.Tensor:
    """ditq's decoder: one Linear's stored tensors -> its float32 weight (out, in)."""
    if scheme.format == "pack-quantized":
        out_features, in_features = (int(v) for v in stored["weight_shape"].tolist())
        q = unpack_int32_to_int8(stored["weight_packed"], (out_features, in_features))
    else:
        q = stored["weight"]
    return dequantize_weight(q, stored["weight_scale"], torch.float32)
