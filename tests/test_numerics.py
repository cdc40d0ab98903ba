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


@pytest.mark.parametrize("num_bits", [4, 8])
def test_unpacking_a_byte_at_a_time_reads_every_word_as_shifting_it_does(
    num_bits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every 16-bit half-word value in both halves of a word (so every byte in every position), and rows cut
    into several reads at a time, some of them past a padded last word: the byte path gives the word-shifting
    path's values, and compressed-tensors'."""
    from ditq import numerics

    halves = torch.arange(0, 1 << 16, dtype=torch.int64)
    words = halves | (halves.roll(1) << 16)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).reshape(-1, 16)
    shape = (words.shape[0], 16 * 32 // num_bits)
    assert torch.equal(
        unpack_int32_to_int(words, shape, num_bits), numerics._unpack_shifting(words, shape, num_bits)
    )
    monkeypatch.setattr(numerics, "UNPACK_ROWS", 3 * 4 * 8)  # three rows of eight words a read
    q = torch.randint(-(1 << num_bits - 1), 1 << num_bits - 1, (10, 61), dtype=torch.int8)
    packed = pack_int_to_int32(q, num_bits)
    assert torch.equal(unpack_int32_to_int(packed, (10, 61), num_bits), q)
    assert torch.equal(unpack_from_int32(packed, num_bits, torch.Size([10, 61])), q)
    with pytest.raises(ValueError, match="cannot hold"):
        unpack_int32_to_int(packed, (10, 62 + 32 // num_bits * 8), num_bits)


def test_relative_l2_summed_a_chunk_at_a_time_is_the_whole_float64_norm_s(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Chunks that end inside a row, bfloat16 against float32, inputs left as they were, broadcasting kept."""
    from ditq import numerics

    monkeypatch.setattr(numerics, "L2_CHUNK", 1000)
    generator = torch.Generator().manual_seed(3)
    reference = torch.randn(37, 129, generator=generator, dtype=torch.float64)
    actual = reference + 1e-3 * torch.randn(37, 129, generator=generator, dtype=torch.float64)
    kept = actual.clone()
    whole = float((actual - reference).norm() / reference.norm())
    assert relative_l2(actual, reference) == pytest.approx(whole, rel=1e-12)
    assert torch.equal(actual, kept)
    half = actual.to(torch.bfloat16)
    assert relative_l2(half, reference.float()) == pytest.approx(
        float((half.double() - reference).norm() / reference.norm()), rel=1e-6
    )
    assert relative_l2(actual, reference[0]) == pytest.approx(
        float((actual - reference[0]).norm() / reference[0].norm()), rel=1e-12
    )
    assert relative_l2(torch.zeros(0), torch.zeros(0)) == 0.0


def test_dequantizing_a_float32_q_leaves_it_as_it_was() -> None:
    q = torch.randint(-7, 8, (8, 64)).to(torch.float32)
    kept, scale = q.clone(), torch.rand(8, 2) + 0.5
    assert torch.equal(
        dequantize_weight(q, scale), (q.reshape(8, 2, 32) * scale.unsqueeze(-1)).reshape(8, 64)
    )
    assert torch.equal(q, kept)


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
