"""4-bit weight GEMMs: int4 weights widened in registers, fp8 (w4a8) or 16-bit (w4a16) tensor-core dots, the group
scales applied to each group's partial sum in float32.

Operands:
- x (M, K): fp8 e4m3 per-token quantized activations, passed as their bytes (uint8; w4a8), or bf16/fp16 (w4a16);
- w (N, K // 2) int8: two int4 values to a byte, two's complement, the even k in the low nibble (the repack of
  compressed-tensors' biased nibbles, ``ditq.kernels.w4_triton``);
- w_scale (N, G) float32, any strides: one scale per output channel and group of K / G (G = 1: per channel); the
  widened w4a8 path hands the (G, N) layout cuBLAS takes, transposed;
- x_scale (M,) float32 (w4a8), bias (N,) or none.
c (M, N) = sum over groups g of (x[:, g] @ q[:, g]^T) * w_scale[:, g] (* x_scale) + bias, in c's dtype.

The weights are the dot's first operand (the tile is computed transposed, (BLOCK_N, BLOCK_M)): Hopper's wgmma takes
its first operand from registers, where the widening leaves the weights, and its second (the activations) from
shared memory; a small M is then the instruction's N, which may be as small as 8. Each BLOCK_K lies inside one group
(BLOCK_K divides the group size): a group's dot starts from zero and is added to the float32 accumulator times its
scale, which is both the exact two-level accumulation fp8 needs (Hopper's fp8 accumulator is narrower than float32)
and the group scaling. int4 values (-8..7) are exact in e4m3 and in 16-bit floats.

Measured on an H100 (benchmarks/results/h100-four-bit/): correct, not fast. The fp8 GEMM ran at 0.39-0.59x ditq
fp8's TFLOP/s from 4096 tokens up, the 16-bit one at 0.39-0.55x BF16 cuBLAS; at 16-256 tokens both are
under-occupied (no split along K). The other operand order (activations first, the weights through shared memory)
ran slower from 4096 tokens up (0.27-0.36x fp8) and was dropped; the widening by shifts (``magic=False``) is kept to
be measured against (benchmarks/kernels_bench.py).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ditq.kernels._triton.w8a8_gemm import _tile_ids

__all__ = ["dequantize_int4", "w4_gemm", "widen_int4_fp8"]

# (BLOCK_N: weight rows, the dot's M; BLOCK_M: tokens, the dot's N; warps; stages). BLOCK_K comes from the group size.
_SHAPES = [
    (128, 256, 8, 3),
    (128, 128, 8, 4),
    (128, 128, 4, 4),
    (256, 128, 8, 3),
    (128, 64, 4, 4),
    (64, 64, 4, 5),
    (128, 32, 4, 4),
    (64, 32, 4, 5),
    (128, 16, 4, 4),
    (64, 16, 4, 6),
]


def _configs() -> list[triton.Config]:
    shapes = _SHAPES
    if os.environ.get("DITQ_TRITON_AUTOTUNE", "1") == "0" or os.environ.get("TRITON_INTERPRET") == "1":
        shapes = [
            (128, 64, 4, 4)
        ]  # correctness runs and Triton's interpreter (which cannot time): one config
    return [
        triton.Config({"BLOCK_N": bn, "BLOCK_M": bm, "GROUP_N": 8}, num_warps=w, num_stages=s)
        for bn, bm, w, s in shapes
    ]


def _prune(configs: list[triton.Config], named_args: dict, **kwargs: object) -> list[triton.Config]:
    """Token tiles no wider than the tokens need (rounded up to 16), and no narrow ones for many tokens."""
    m = named_args["M"]
    widest = max(16, triton.next_power_of_2(m))
    kept = [c for c in configs if c.kwargs["BLOCK_M"] <= widest and (m <= 1024 or c.kwargs["BLOCK_M"] >= 64)]
    return kept or configs


@triton.jit
def _widen(b, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """(BLOCK_N, BLOCK_K // 2) int8 bytes -> (BLOCK_N, BLOCK_K) int32 values, k = 2 * byte + (0 low, 1 high)."""
    word = b.to(tl.int32)
    low = (word << 28) >> 28
    high = (word << 24) >> 28
    return tl.reshape(tl.join(low, high), (BLOCK_N, BLOCK_K))


@triton.jit
def _widen_f16(b, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MAGIC: tl.constexpr):
    """The same values as float16. MAGIC: through the float16 bits of 1024 + biased nibble, less 1032 (no
    integer-to-float conversion); else shifts and a conversion."""
    if MAGIC:
        word = b.to(tl.int32)
        low = ((word & 0xF) ^ 0x8) | 0x6400
        high = (((word >> 4) & 0xF) ^ 0x8) | 0x6400
        bits = tl.reshape(tl.join(low, high), (BLOCK_N, BLOCK_K)).to(tl.int16)
        return bits.to(tl.float16, bitcast=True) - 1032.0
    return _widen(b, BLOCK_N, BLOCK_K).to(tl.float16)


@triton.autotune(
    configs=_configs(),
    key=["M_BUCKET", "N", "K", "GROUP_SIZE", "MAGIC"],
    prune_configs_by={"early_config_prune": _prune},
)
@triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})
@triton.jit
def _w4_kernel(
    x_ptr,
    w_ptr,
    c_ptr,
    x_scale_ptr,
    w_scale_ptr,
    bias_ptr,
    M,
    N,
    K,
    M_BUCKET,
    GROUP_SIZE,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_sg,
    stride_cm,
    HAS_BIAS: tl.constexpr,
    IS_FP8: tl.constexpr,
    GROUPED: tl.constexpr,
    MAGIC: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    GROUP_N: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    # w8a8's tile order with the roles swapped: consecutive programs share a band of GROUP_N weight tiles
    pid_n, pid_m = _tile_ids(N, M, BLOCK_N, BLOCK_M, GROUP_N)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    offs_b = tl.arange(0, BLOCK_K // 2)
    # Rows past N / M re-read valid rows (results masked at the store): no row masks in the loop.
    rows_w = (offs_n % N).to(tl.int64)
    rows_x = (offs_m % M).to(tl.int64)
    w_ptrs = w_ptr + rows_w[:, None] * stride_wn + offs_b[None, :]  # (BLOCK_N, BLOCK_K // 2)
    x_ptrs = x_ptr + rows_x[None, :] * stride_xm + offs_k[:, None]  # (BLOCK_K, BLOCK_M), K contiguous
    scale_ptrs = w_scale_ptr + rows_w * stride_sn
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            b = tl.load(w_ptrs)
            x = tl.load(x_ptrs)
        else:
            k_left = K - k * BLOCK_K
            b = tl.load(w_ptrs, mask=offs_b[None, :] < k_left // 2, other=0)
            x = tl.load(x_ptrs, mask=offs_k[:, None] < k_left, other=0)
        q = _widen_f16(b, BLOCK_N, BLOCK_K, MAGIC)
        if IS_FP8:
            x = x.to(tl.float8e4nv, bitcast=True)
            w = q.to(tl.float8e4nv)
        else:
            w = q.to(x.dtype)
        if GROUPED:
            part = tl.dot(w, x, out_dtype=tl.float32)
            scale = tl.load(scale_ptrs + ((k * BLOCK_K) // GROUP_SIZE) * stride_sg)
            acc += part * scale[:, None]
        elif IS_FP8:
            acc = tl.dot(w, x, acc, out_dtype=tl.float32, max_num_imprecise_acc=BLOCK_K)
        else:
            acc = tl.dot(w, x, acc, out_dtype=tl.float32)
        w_ptrs += BLOCK_K // 2
        x_ptrs += BLOCK_K
    if not GROUPED:
        acc *= tl.load(scale_ptrs)[:, None]
    if IS_FP8:
        acc *= tl.load(x_scale_ptr + offs_m, mask=offs_m < M, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
    c_ptrs = c_ptr + offs_m[None, :].to(tl.int64) * stride_cm + offs_n[:, None]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[None, :] < M) & (offs_n[:, None] < N))


def w4_gemm(
    x: torch.Tensor,
    x_scale: torch.Tensor | None,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    block_k: int,
    magic: bool = True,
) -> torch.Tensor:
    """c (M, N) = x @ dequant(w)^T (* x_scale) + bias; x fp8 (with x_scale (M,)) or bf16/fp16 (x_scale None);
    ``block_k`` the K tile, which divides the group size (``ditq.kernels.w4_triton.block_k_for``).
    ``magic`` False runs the widening by shifts and an integer
    conversion (measured against, not shipped: on an H100 the float16-bits widening ran the fp8 GEMM at 0.39-0.59x
    ditq fp8's TFLOP/s for 4096 tokens and more, the shifts at 0.33-0.44x)."""
    m, k = x.shape
    n = w.shape[0]
    groups = w_scale.shape[1]
    if w.shape[1] * 2 != k or k % groups or (groups > 1 and (k // groups) % block_k):
        raise ValueError(f"w4 GEMM: weight {tuple(w.shape)} with {groups} scale groups does not fit K = {k}")
    is_fp8 = x.dtype == torch.float8_e4m3fn
    if is_fp8 != (x_scale is not None):
        raise ValueError("w4 GEMM: fp8 activations come with their per-token scale, 16-bit ones without")
    c = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0:
        return c
    x_bytes = x.view(torch.uint8) if is_fp8 else x

    def grid(meta: dict) -> tuple[int]:
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

    _w4_kernel[grid](
        x_bytes,
        w,
        c,
        x_scale if x_scale is not None else w_scale,  # unread without fp8
        w_scale,
        bias if bias is not None else w_scale,  # unread without a bias
        m,
        n,
        k,
        triton.next_power_of_2(m),
        k // groups,
        x_bytes.stride(0),
        w.stride(0),
        w_scale.stride(0),
        w_scale.stride(1),
        c.stride(0),
        HAS_BIAS=bias is not None,
        IS_FP8=is_fp8,
        GROUPED=groups > 1,
        MAGIC=magic,
        BLOCK_K=block_k,
    )
    return c


@triton.jit
def _dequant4_kernel(w_ptr, scale_ptr, out_ptr, K, GROUP_SIZE, stride_sn, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # k
    mask = offs < K
    word = tl.load(w_ptr + row * (K // 2) + offs // 2, mask=mask, other=0).to(tl.int32)
    shift = 28 - 4 * (offs % 2)  # low nibble for even k, high for odd
    q = ((word << shift) >> 28).to(tl.float32)
    s = tl.load(scale_ptr + row * stride_sn + offs // GROUP_SIZE, mask=mask, other=0.0)
    tl.store(out_ptr + row * K + offs, (q * s).to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_int4(w: torch.Tensor, w_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """w (N, K // 2) int8 (the kernels' repack) and w_scale (N, G) float32 -> (N, K) in ``dtype``: q * scale in
    float32, one rounding."""
    n, k = w.shape[0], w.shape[1] * 2
    out = torch.empty((n, k), dtype=dtype, device=w.device)
    block = 2048
    _dequant4_kernel[(n, triton.cdiv(k, block))](
        w, w_scale, out, k, k // w_scale.shape[1], w_scale.stride(0), BLOCK=block
    )
    return out


@triton.jit
def _widen_fp8_kernel(w_ptr, out_ptr, NUMEL, BLOCK: tl.constexpr):
    """BLOCK bytes of two int4 values each -> 2 * BLOCK e4m3 bytes, each byte's low nibble first."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    word = tl.load(w_ptr + offs, mask=offs < NUMEL, other=0).to(tl.int32)
    low = (word << 28) >> 28
    high = (word << 24) >> 28
    values = tl.reshape(tl.join(low, high), (2 * BLOCK,)).to(tl.float16).to(tl.float8e4nv)
    out_offs = tl.program_id(0).to(tl.int64) * (2 * BLOCK) + tl.arange(0, 2 * BLOCK)
    tl.store(out_ptr + out_offs, values.to(tl.uint8, bitcast=True), mask=out_offs < 2 * NUMEL)


def widen_int4_fp8(w: torch.Tensor) -> torch.Tensor:
    """w (N, K // 2) int8 (the kernels' repack) -> (N, K) float8 e4m3 holding the int4 values themselves (-8..7 are
    exact in e4m3): the unscaled weight a cuBLAS fp8 GEMM takes, the scales left to it. Transient, one layer at a
    time: K bytes a row against the repack's K / 2."""
    n, k = w.shape[0], w.shape[1] * 2
    out = torch.empty((n, k), dtype=torch.uint8, device=w.device)
    block = 1024
    _widen_fp8_kernel[(triton.cdiv(w.numel(), block),)](w, out, w.numel(), BLOCK=block)
    return out.view(torch.float8_e4m3fn)
