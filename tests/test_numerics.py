"""The shared arithmetic: quantize/dequantize error, compressed-tensors' packing, band encoding."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

from ditq.numerics import (
    dequantize_weight,
    pack_int_to_int32,
    quantize_activation_per_token,
    quantize_weight,
    relative_l2,
    unpack_int32_to_int,
)
from ditq.quantization.rewrite import encode_band
from ditq.schemes import FP8, W4A16, W8A8, W8A16

# (scheme, expected rel-L2 ceiling on Gaussian weights): int8 per channel ~0.01, e4m3 ~0.025.
ERROR_CASES = [
    (W8A16, 0.015),
    (W8A16.with_group_size(32), 0.012),
    (W8A8, 0.015),
    (FP8, 0.035),
    (W4A16.with_group_size(32), 0.2),
]


def _weight(out_features: int = 64, in_features: int = 128) -> torch.Tensor:
    return torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(0)).bfloat16()


@pytest.mark.parametrize(("scheme", "ceiling"), ERROR_CASES, ids=lambda v: getattr(v, "name", str(v)))
def test_round_trip_error(scheme, ceiling: float) -> None:  # type: ignore[no-untyped-def]
    weight = _weight()
    q, scale = quantize_weight(weight, scheme)
    assert q.dtype == scheme.weight_dtype and q.shape == weight.shape
    groups = 1 if scheme.group_size is None else 128 // scheme.group_size
    assert scale.dtype == torch.float32 and scale.shape == (64, groups)
    error = relative_l2(dequantize_weight(q, scale), weight)
    assert 0 < error < ceiling


def test_int8_uses_the_full_symmetric_range() -> None:
    q, _ = quantize_weight(_weight(), W8A8)
    assert int(q.abs().amax(dim=1).min()) == 127
    assert int(q.min()) >= -127


def test_packing_matches_compressed_tensors() -> None:
    q = torch.randint(-127, 128, (32, 64), dtype=torch.int8)
    ours = pack_int_to_int32(q)
    theirs = pack_to_int32(q, 8)
    assert ours.dtype == torch.int32 and ours.shape == (32, 16)
    assert torch.equal(ours, theirs)
    assert torch.equal(unpack_int32_to_int(ours, (32, 64)), q)
    assert torch.equal(unpack_from_int32(ours, 8, torch.Size([32, 64])), q)


@pytest.mark.parametrize("in_features", [64, 60])
def test_four_bit_packing_matches_compressed_tensors(in_features: int) -> None:
    q = torch.randint(-8, 8, (32, in_features), generator=torch.Generator().manual_seed(7), dtype=torch.int8)
    ours = pack_int_to_int32(q, 4)
    theirs = pack_to_int32(q, 4)
    assert ours.dtype == torch.int32 and ours.shape == (32, (in_features + 7) // 8)
    assert torch.equal(ours, theirs)
    assert torch.equal(unpack_int32_to_int(ours, (32, in_features), 4), q)
    assert torch.equal(unpack_from_int32(ours, 4, torch.Size([32, in_features])), q)


def test_four_bit_weights_use_seven_levels_each_side() -> None:
    q, scale = quantize_weight(_weight(), W4A16.with_group_size(32))
    assert int(q.abs().amax()) == 7 and int(q.min()) >= -7
    assert scale.shape == (_weight().shape[0], _weight().shape[1] // 32)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_activation_per_token(kind: str) -> None:
    x = torch.randn(3, 5, 64)
    q, scale = quantize_activation_per_token(x, kind)
    assert scale.shape == (3, 5, 1)
    assert relative_l2(q.to(torch.float32) * scale, x) < (0.01 if kind == "int8" else 0.04)


@pytest.mark.parametrize("scheme", [W8A16, W8A16.with_group_size(32), W8A8, FP8], ids=lambda s: s.name)
def test_bands_encode_like_the_whole_tensor(scheme) -> None:  # type: ignore[no-untyped-def]
    weight = _weight(96, 128)
    whole = encode_band(weight, scheme)
    bands = [encode_band(weight[i : i + 40], scheme) for i in range(0, 96, 40)]
    assert torch.equal(torch.cat([b.stored_rows for b in bands]), whole.stored_rows)
    assert torch.equal(torch.cat([b.scale for b in bands]), whole.scale)
    assert sum(b.error_sq for b in bands) == pytest.approx(whole.error_sq, rel=1e-5)
