"""Reading one Linear's stored tensors (compressed-tensors layout) into plain (q, scale) pairs.

Every path's ``prepare`` starts here, so a malformed tensor is reported the
same way everywhere: one line naming the tensor.
"""

from __future__ import annotations

import torch

from ditq.errors import InputError
from ditq.kernels.registry import StoredWeight
from ditq.numerics import pack_int8_to_int32, unpack_int32_to_int8

__all__ = [
    "analytic_stored",
    "stored_fp8_weight",
    "stored_from_quantized",
    "stored_int8_weight",
    "unpack_w8a16",
]


def analytic_stored(scheme_name: str, out_features: int, in_features: int) -> dict[str, torch.Tensor]:
    """Every q = qmax, scale = 1/qmax (127 for int8; 448, e4m3's largest, for fp8): W is all ones.

    With an all-ones input every output equals ``in_features`` (exactly, up to the output dtype's rounding).
    """
    qmax = 448.0 if scheme_name == "fp8" else 127.0
    dtype = torch.float8_e4m3fn if scheme_name == "fp8" else torch.int8
    q = torch.full((out_features, in_features), qmax).to(dtype)
    scale = torch.full((out_features, 1), 1.0 / qmax, dtype=torch.float32)
    return stored_from_quantized(q, scale, scheme_name)


def stored_from_quantized(q: torch.Tensor, scale: torch.Tensor, scheme_name: str) -> dict[str, torch.Tensor]:
    """(q (out, in), scale) -> the tensors a checkpoint stores for one Linear under ``scheme_name``."""
    if scheme_name == "w8a16":
        return {
            "weight_packed": pack_int8_to_int32(q),
            "weight_scale": scale,
            "weight_shape": torch.tensor(list(q.shape), dtype=torch.int64),
        }
    return {"weight": q, "weight_scale": scale}


def _require(stored: StoredWeight, key: str, dtype: torch.dtype, ndim: int) -> torch.Tensor:
    if key not in stored:
        raise InputError(f"stored weight lacks {key!r} (has {sorted(stored)})")
    t = stored[key]
    if t.dtype != dtype or t.ndim != ndim:
        raise InputError(f"stored {key!r} is {t.dtype} {tuple(t.shape)}, expected {dtype} with {ndim} dims")
    return t


def _scale(stored: StoredWeight, out_features: int, in_features: int) -> torch.Tensor:
    scale = _require(stored, "weight_scale", torch.float32, 2)
    if scale.shape[0] != out_features or in_features % scale.shape[1]:
        raise InputError(
            f"stored 'weight_scale' {tuple(scale.shape)} does not fit a ({out_features}, {in_features}) weight"
        )
    return scale


def unpack_w8a16(stored: StoredWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """w8a16 stored tensors -> (q int8 (out, in), scale float32 (out, 1|groups)), on the stored device."""
    packed = _require(stored, "weight_packed", torch.int32, 2)
    shape_t = _require(stored, "weight_shape", torch.int64, 1)
    out_features, in_features = (int(v) for v in shape_t.tolist())
    if packed.shape != (out_features, (in_features + 3) // 4):
        raise InputError(
            f"stored 'weight_packed' {tuple(packed.shape)} does not hold a ({out_features}, {in_features}) weight"
        )
    q = unpack_int32_to_int8(packed, (out_features, in_features))
    return q, _scale(stored, out_features, in_features)


def stored_int8_weight(stored: StoredWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """w8a8 stored tensors -> (q int8 (out, in), scale float32 (out, 1))."""
    q = _require(stored, "weight", torch.int8, 2)
    return q, _scale(stored, *q.shape)


def stored_fp8_weight(stored: StoredWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 stored tensors -> (q float8_e4m3fn (out, in), scale float32 (out, 1))."""
    q = _require(stored, "weight", torch.float8_e4m3fn, 2)
    return q, _scale(stored, *q.shape)
