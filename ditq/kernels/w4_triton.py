"""CUDA 4-bit weights: w4a8 (int4 weights x per-token fp8 activations on fp8 tensor cores, sm_89+) and w4a16 (int4
weights x bf16/fp16 activations, sm_80+) through one Triton GEMM (``_triton.w4_gemm``), w4a16 as dequantize +
cuBLAS, and w4a8 from ``widen_min_rows`` tokens as widen + cuBLAS's fp8 GEMM (sm_90: the int4 values widened to
e4m3 unscaled, which is exact, and the group scales handed to ``torch._scaled_mm`` as its 1x128 blockwise scaling,
the fp32 promotion per 128 of K that the Triton GEMM does by hand) (ops ``ditq::w4a8_triton``, ``ditq::w4a8_widened``,
``ditq::w4a16_triton``, ``ditq::w4a16_dequant_matmul``).

The repack keeps the weights at 4 bits: compressed-tensors' int32 words hold eight nibbles biased by 8, low nibble
first, so their bytes (little-endian) are already two values each in k order; flipping each nibble's top bit
(``^ 0x88``) makes them two's complement, which the kernel widens with two shifts. The scales stay (N, groups)
float32; the widened path lays them out once, at load, as cuBLAS takes them (``repack_int4_widened``). No 16-bit
weight is ever materialised, except transiently, one layer at a time, by the dequantize path (and the widened e4m3
weight, one byte a value, by the widening path).
"""

from __future__ import annotations

import torch

from ditq.checkpoint.codecs import codec_for
from ditq.errors import InputError
from ditq.kernels.cuda_common import (
    cuda_op,
    matmul_quantized_rows,
    matmul_rows,
    register_quantized_row_fakes,
    register_row_fakes,
    triton_available,
)
from ditq.kernels.registry import HALF_ACTIVATIONS, Prepared, StoredWeight, register_kernel
from ditq.schemes import W4A8, W4A16

__all__ = ["block_k_for", "cublas_weight_scales", "repack_int4", "repack_int4_widened", "widen_min_rows"]

# Tokens up to which the w4a16 path runs the Triton GEMM on the packed weights; above, dequantize + cuBLAS. On an
# H100 (benchmarks/results/h100-four-bit/) dequantize + cuBLAS ran at 0.88-1.07x BF16 from 4096 tokens up, the Triton
# GEMM at 0.39-0.55x; at 16 and 256 tokens only the Triton GEMM was measured (0.31-1.16x BF16: no split along K).
W4A16_TRITON_MAX_ROWS = 256
# Where the widen-scaled-mm-w4a8 path widens the int4 weight to e4m3 and leaves the GEMM to cuBLAS (else the Triton
# GEMM on the packed weight): from W4A8_WIDEN_MIN_ROWS tokens, and only once the GEMM's M x K x N reaches
# W4A8_WIDEN_MIN_WORK, in a layer of at least W4A8_WIDEN_MIN_WEIGHTS values. On an H100 (run 5 in
# benchmarks/results/h100-four-bit/, both timed at 16-20736 tokens, the scales laid out at load) the widened GEMM won
# from 2^33.6 up (256 tokens at 12288 x 4096: 0.083 ms against 0.130; 1024 tokens at 4096 x 4096: 0.080 against
# 0.090; 4096 tokens at 4096 x 1024: 0.075 against 0.103; a tie at 256 tokens, 4096 x 12288) and lost from 2^32
# down (256 tokens at 4096 x 4096: 0.077 against 0.056; 1024 tokens at 4096 x 1024: 0.074 against 0.060). Smaller
# layers (the 64-wide patch projections) and fewer tokens were not timed on both sides: Triton's.
W4A8_WIDEN_MIN_ROWS = 256
W4A8_WIDEN_MIN_WORK = 1 << 33
W4A8_WIDEN_MIN_WEIGHTS = 1 << 22


def widen_min_rows(in_features: int, out_features: int) -> int | None:
    """The token count from which the widened w4a8 path hands a layer of this shape to cuBLAS, or None when it
    never does (a layer under ``W4A8_WIDEN_MIN_WEIGHTS`` values)."""
    weights = in_features * out_features
    if weights < W4A8_WIDEN_MIN_WEIGHTS:
        return None
    return max(W4A8_WIDEN_MIN_ROWS, -(-W4A8_WIDEN_MIN_WORK // weights))


def block_k_for(in_features: int, groups: int) -> int | None:
    """The 4-bit GEMM's K tile for a layer of ``in_features`` with ``groups`` scale columns: the largest of 128, 64
    and 32 that divides the group size (per channel: 128, or the power of two covering a narrower K, the tail
    masked), or None when none does."""
    if groups == 1:
        return 128 if in_features >= 128 else max(32, 1 << (in_features - 1).bit_length())
    group_size = in_features // groups
    return next((bk for bk in (128, 64, 32) if group_size % bk == 0), None)


def repack_int4(stored: StoredWeight, device: torch.device) -> Prepared:
    """The 4-bit paths' repack: weight (N, K / 2) int8, two's-complement nibbles, even k low; weight_scale (N, G)
    float32. A group size that no K tile of the kernel divides is an InputError (the doctor then refuses the path)."""
    codec = codec_for(W4A16)
    out_features, in_features = codec.features(stored)
    packed = stored["weight_packed"]
    if (
        in_features % 8
        or tuple(packed.shape) != (out_features, in_features // 8)
        or packed.dtype != torch.int32
    ):
        raise InputError(
            f"stored 'weight_packed' {packed.dtype} {tuple(packed.shape)} does not hold a ({out_features}, "
            f"{in_features}) 4-bit weight whole words at a time"
        )
    scale = stored["weight_scale"]
    if scale.ndim != 2 or scale.shape[0] != out_features or in_features % scale.shape[1]:
        raise InputError(
            f"stored 'weight_scale' {tuple(scale.shape)} does not fit ({out_features}, {in_features})"
        )
    if block_k_for(in_features, scale.shape[1]) is None:
        raise InputError(
            f"group size {in_features // scale.shape[1]}: the 4-bit CUDA kernels take groups of a multiple of 32"
        )
    flipped = packed.to(device).contiguous().view(torch.uint8) ^ 0x88
    return {
        "weight": flipped.view(torch.int8).reshape(out_features, in_features // 2),
        "weight_scale": scale.to(device, torch.float32).contiguous(),
    }


def _block_k(weight: torch.Tensor, weight_scale: torch.Tensor) -> int:
    """The K tile of a repacked layer (its group size checked by ``repack_int4``)."""
    block_k = block_k_for(weight.shape[1] * 2, weight_scale.shape[1])
    assert block_k is not None, "repack_int4 refuses a group size no K tile divides"
    return block_k


def _w4a8_gemm(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    from ditq.kernels._triton.w4_gemm import w4_gemm

    return w4_gemm(x_q, x_scale, weight, weight_scale, bias, out_dtype, _block_k(weight, weight_scale))


def _w4a16_gemm(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    from ditq.kernels._triton.w4_gemm import w4_gemm

    return w4_gemm(x, None, weight, weight_scale, bias, x.dtype, _block_k(weight, weight_scale))


def _w4a16_dequant_matmul(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    from ditq.kernels._triton.w4_gemm import dequantize_int4, w4_gemm

    if x.shape[0] <= W4A16_TRITON_MAX_ROWS and x.dtype in HALF_ACTIVATIONS:
        return w4_gemm(x, None, weight, weight_scale, bias, x.dtype, _block_k(weight, weight_scale))
    w = dequantize_int4(weight, weight_scale, x.dtype)  # (N, K) in x's dtype, transient
    return torch.nn.functional.linear(x, w, bias)


def _cublas_scale_rows(in_features: int, groups: int) -> int | None:
    """How many rows of scales cuBLAS's fp8 GEMM takes for a widened weight of ``in_features`` in ``groups`` scale
    groups: 1 per channel (rowwise), K / 128 for groups of a multiple of 128 (1x128 blockwise, sm_90); None for any
    other grouping, and for a K it does not take (not a multiple of 16)."""
    if in_features % 16:
        return None
    if groups == 1:
        return 1
    return None if (in_features // groups) % 128 else in_features // 128


def cublas_weight_scales(weight_scale: torch.Tensor, in_features: int) -> torch.Tensor | None:
    """The (N, G) group scales as ``torch._scaled_mm`` takes them for the widened (N, K) weight: per channel, (1, N)
    (rowwise); groups of a multiple of 128, one scale per 128 of K as a (K / 128, N) row-major tensor (cuBLAS's 1x128
    blockwise scaling, sm_90), a group of 256 or more repeated over its 128s. None where ``_cublas_scale_rows`` is."""
    rows = _cublas_scale_rows(in_features, weight_scale.shape[1])
    if rows is None:
        return None
    if rows == 1:
        return weight_scale.reshape(1, -1)
    return weight_scale.repeat_interleave(rows // weight_scale.shape[1], dim=1).t().contiguous()


def repack_int4_widened(stored: StoredWeight, device: torch.device) -> Prepared:
    """The widened w4a8 path's repack: ``repack_int4``'s weight, and its scales laid out once, at load, as
    ``torch._scaled_mm`` takes them for the widened weight (``cublas_weight_scales``): (1, N) per channel,
    (K / 128, N) for groups of a multiple of 128. A grouping cuBLAS cannot scale keeps its scales as (G, N). Either
    way weight_scale is (G', N), and the Triton GEMM below the split reads it transposed."""
    prepared = repack_int4(stored, device)
    scale = prepared["weight_scale"]
    cublas = cublas_weight_scales(scale, prepared["weight"].shape[1] * 2)
    prepared["weight_scale"] = (cublas if cublas is not None else scale.t()).contiguous()
    return prepared


def _w4a8_widened_gemm(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """weight_scale (G', N) as ``repack_int4_widened`` lays it out."""
    from ditq.kernels._triton.w4_gemm import widen_int4_fp8

    m, k = x_q.shape
    split = widen_min_rows(k, weight.shape[0])
    scale_rows = weight_scale.shape[0]  # in cuBLAS's layout where it has one: as many rows as it takes
    if (
        split is None
        or m < split
        or out_dtype != torch.bfloat16
        or _cublas_scale_rows(k, scale_rows) != scale_rows
    ):
        return _w4a8_gemm(x_q, x_scale, weight, weight_scale.t(), bias, out_dtype)
    if scale_rows == 1:
        scale_a = x_scale.reshape(m, 1)
    else:  # the token's one scale for each 128 of K, (M, K / 128) column-major as cuBLAS reads it; cuBLAS finds no
        # blockwise algorithm for a token count that is not a multiple of 4: pad the rows, drop them after
        rows = -(-m // 4) * 4
        if rows != m:
            x_q = torch.nn.functional.pad(x_q.view(torch.uint8), (0, 0, 0, rows - m)).view(x_q.dtype)
            x_scale = torch.nn.functional.pad(x_scale, (0, rows - m), value=1.0)
        scale_a = x_scale.reshape(1, rows).expand(k // 128, rows).contiguous().t()
    y = torch._scaled_mm(
        x_q, widen_int4_fp8(weight).t(), scale_a=scale_a, scale_b=weight_scale, out_dtype=torch.bfloat16
    )[:m]
    if bias is not None:
        y.add_(bias.to(y.dtype))
    return y


w4a8_triton = cuda_op("ditq::w4a8_triton", _w4a8_gemm)
w4a8_widened = cuda_op("ditq::w4a8_widened", _w4a8_widened_gemm)
register_quantized_row_fakes(w4a8_triton, w4a8_widened)
w4a16_triton = cuda_op("ditq::w4a16_triton", _w4a16_gemm)
w4a16_dequant_matmul = cuda_op("ditq::w4a16_dequant_matmul", _w4a16_dequant_matmul)
register_row_fakes(w4a16_triton, w4a16_dequant_matmul)

# What every 4-bit path shares; K a multiple of 8: whole int32 words (the loads are masked pointer loads, so no wider
# alignment is needed).
_COMMON = {"device_type": "cuda", "prepare": repack_int4, "alignment": 8, "available": triton_available}


@register_kernel(
    name="triton-w4a8",
    scheme=W4A8,
    priority=80,
    min_capability=(8, 9),
    activation_dtypes=HALF_ACTIVATIONS,
    **_COMMON,  # type: ignore[arg-type]
)
def matmul_w4a8(x: torch.Tensor, prepared: Prepared, bias: torch.Tensor | None) -> torch.Tensor:
    """Triton: per-token fp8 quantization, int4 weights widened to e4m3 in registers, fp8 dot, group scales in
    float32."""
    return matmul_quantized_rows(w4a8_triton, x, prepared, bias, "fp8")


@register_kernel(
    name="widen-scaled-mm-w4a8",
    scheme=W4A8,
    priority=85,
    min_capability=(9, 0),
    activation_dtypes=frozenset({torch.bfloat16}),
    split_rows=widen_min_rows,
    **{**_COMMON, "prepare": repack_int4_widened},  # type: ignore[arg-type]
)
def matmul_w4a8_widened(x: torch.Tensor, prepared: Prepared, bias: torch.Tensor | None) -> torch.Tensor:
    """From ``widen_min_rows`` tokens: the int4 weight widened to e4m3 (Triton), then cuBLAS's fp8 GEMM scaling
    each 128 of K (sm_90) or each channel; below, and for other groupings, the Triton GEMM."""
    return matmul_quantized_rows(w4a8_widened, x, prepared, bias, "fp8")


@register_kernel(
    name="triton-w4a16",
    scheme=W4A16,
    priority=80,
    min_capability=(8, 0),
    activation_dtypes=HALF_ACTIVATIONS,
    **_COMMON,  # type: ignore[arg-type]
)
def matmul_w4a16(x: torch.Tensor, prepared: Prepared, bias: torch.Tensor | None) -> torch.Tensor:
    """Triton: int4 weights widened to 16 bits in registers, 16-bit dot, group scales in float32."""
    return matmul_rows(w4a16_triton, x, prepared, bias)


@register_kernel(
    name="dequant-matmul-w4a16",
    scheme=W4A16,
    priority=85,
    min_capability=(8, 0),
    activation_dtypes=HALF_ACTIVATIONS | {torch.float32},
    split_rows=W4A16_TRITON_MAX_ROWS + 1,
    **_COMMON,  # type: ignore[arg-type]
)
def matmul_w4a16_dequant(x: torch.Tensor, prepared: Prepared, bias: torch.Tensor | None) -> torch.Tensor:
    """The Triton GEMM up to 256 tokens; above, dequantize to the activation dtype (Triton), then cuBLAS."""
    return matmul_rows(w4a16_dequant_matmul, x, prepared, bias)
