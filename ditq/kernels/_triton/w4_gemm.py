"""4-bit weight GEMMs: int4 weights widened in registers, fp8 (w4a8) or 16-bit (w4a16) tensor-core dots, the group
scales applied to each group's partial sum in float32.

Operands:
- x (M, K): fp8 e4m3 per-token quantized activations, passed as their bytes (uint8; w4a8), or bf16/fp16 (w4a16);
- w (N, K // 2) uint8: the repack of compressed-tensors' nibbles (``ditq.kernels.w4_triton.repack_int4``), still
  biased by 8, laid out in halves of each K tile: in the tile of length L that starts at k0, byte k0 / 2 + j holds
  k0 + j in its low nibble and k0 + L / 2 + j in its high one (L is BLOCK_K, or the shorter rest of a per-channel K);
- w_scale (N, G) float32: one scale per output channel and group of K / G (G = 1: per channel);
- x_scale (M,) float32 (w4a8), bias (N,) or none.
c (M, N) = sum over groups g of (x[:, g] @ q[:, g]^T) * w_scale[:, g] (* x_scale) + bias, in c's dtype.

The weights are the dot's first operand (the tile is computed transposed, (BLOCK_N, BLOCK_M)): Hopper's wgmma takes
its first operand from registers, where the widening leaves the weights, and its second (the activations) from
shared memory; a small M is then the instruction's N, which may be as small as 8. The halves layout makes the
widening elementwise: a byte's two nibbles become one value in each of two (BLOCK_N, BLOCK_K / 2) tiles of the same
layout as the loaded bytes, dotted with the activations' two halves of the K tile, so no value is moved between
threads after the load (the earlier layout, two consecutive k to a byte, needed a join and a reshape between the
load and the dot). For fp8 the widening is a few PTX instructions on four bytes at a time (``_E4M3_FROM_NIBBLES``:
each nibble placed in the float16 bits of 1024 + nibble, less 1032, converted two at a time to e4m3). Each BLOCK_K
lies inside one group (BLOCK_K divides the group size): a group's dots start from zero and are added to the float32
accumulator times its scale, which is both the exact two-level accumulation fp8 needs (Hopper's fp8 accumulator is
narrower than float32) and the group scaling. int4 values (-8..7) are exact in e4m3 and in 16-bit floats.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ditq.kernels._triton.w8a8_gemm import _tile_ids

__all__ = ["dequantize_int4", "w4_gemm"]

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

# Four bytes of biased nibbles ($2) -> the e4m3 bytes of their low nibbles ($0) and of their high ones ($1), each
# value nibble - 8: bytes [u, 0x64] are the float16 1024 + u, less 1032 (0x6408) exact, then two to e4m3 at once.
_E4M3_FROM_NIBBLES = """
{
.reg .b32 n, h0, h1, bias, magic;
.reg .b16 e0, e1;
mov.b32 bias, 0x64086408;
mov.b32 magic, 0x64646464;
and.b32 n, $2, 0x0F0F0F0F;
prmt.b32 h0, n, magic, 0x4140;
prmt.b32 h1, n, magic, 0x4342;
sub.f16x2 h0, h0, bias;
sub.f16x2 h1, h1, bias;
cvt.rn.satfinite.e4m3x2.f16x2 e0, h0;
cvt.rn.satfinite.e4m3x2.f16x2 e1, h1;
mov.b32 $0, {e0, e1};
shr.u32 n, $2, 4;
and.b32 n, n, 0x0F0F0F0F;
prmt.b32 h0, n, magic, 0x4140;
prmt.b32 h1, n, magic, 0x4342;
sub.f16x2 h0, h0, bias;
sub.f16x2 h1, h1, bias;
cvt.rn.satfinite.e4m3x2.f16x2 e0, h0;
cvt.rn.satfinite.e4m3x2.f16x2 e1, h1;
mov.b32 $1, {e0, e1};
}
"""


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _configs() -> list[triton.Config]:
    shapes = _SHAPES
    if os.environ.get("DITQ_TRITON_AUTOTUNE", "1") == "0" or _interpreted():
        shapes = [(128, 64, 4, 4)]  # correctness runs and the interpreter (which cannot time): one config
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
def _widen(b, IS_FP8: tl.constexpr, ASM: tl.constexpr, dtype: tl.constexpr):
    """(BLOCK_N, H) bytes -> the values of their low nibbles and of their high ones, each (BLOCK_N, H) in ``dtype``
    (e4m3 or the activations' 16-bit type). ASM: fp8 only, four bytes per few instructions (``_E4M3_FROM_NIBBLES``);
    else Triton's own arithmetic (also what the interpreter runs)."""
    if ASM:
        low, high = tl.inline_asm_elementwise(
            _E4M3_FROM_NIBBLES, "=r,=r,r", [b], dtype=(tl.uint8, tl.uint8), is_pure=True, pack=4
        )
        return low.to(tl.float8e4nv, bitcast=True), high.to(tl.float8e4nv, bitcast=True)
    low = (b & 0xF).to(tl.float16) - 8.0
    high = (b >> 4).to(tl.float16) - 8.0
    return low.to(dtype), high.to(dtype)


@triton.jit
def _tile(
    acc,
    b,
    x_low,
    x_high,
    scale,
    IS_FP8: tl.constexpr,
    GROUPED: tl.constexpr,
    ASM: tl.constexpr,
    HALF_K: tl.constexpr,
):
    """One K tile: the widened halves dotted with the activations' halves, added to ``acc`` (grouped: the tile's
    fresh partial sum times its scale)."""
    if IS_FP8:
        x_low = x_low.to(tl.float8e4nv, bitcast=True)
        x_high = x_high.to(tl.float8e4nv, bitcast=True)
    w_low, w_high = _widen(b, IS_FP8, ASM, x_low.dtype)
    if GROUPED:
        part = tl.dot(w_low, x_low, out_dtype=tl.float32)
        part = tl.dot(w_high, x_high, part, out_dtype=tl.float32)
        acc += part * scale[:, None]
    elif IS_FP8:  # per channel: promoted to float32 after each half
        acc = tl.dot(w_low, x_low, acc, out_dtype=tl.float32, max_num_imprecise_acc=HALF_K)
        acc = tl.dot(w_high, x_high, acc, out_dtype=tl.float32, max_num_imprecise_acc=HALF_K)
    else:
        acc = tl.dot(w_low, x_low, acc, out_dtype=tl.float32)
        acc = tl.dot(w_high, x_high, acc, out_dtype=tl.float32)
    return acc


@triton.autotune(
    configs=_configs(),
    key=["M_BUCKET", "N", "K", "GROUP_SIZE", "ASM"],
    prune_configs_by={"early_config_prune": _prune},
)
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
    stride_cm,
    HAS_BIAS: tl.constexpr,
    IS_FP8: tl.constexpr,
    GROUPED: tl.constexpr,
    ASM: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    GROUP_N: tl.constexpr,
):
    HALF: tl.constexpr = BLOCK_K // 2
    # w8a8's tile order with the roles swapped: consecutive programs share a band of GROUP_N weight tiles
    pid_n, pid_m = _tile_ids(N, M, BLOCK_N, BLOCK_M, GROUP_N)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_h = tl.arange(0, HALF)
    # Rows past N / M re-read valid rows (results masked at the store): no row masks in the loop.
    rows_w = (offs_n % N).to(tl.int64)
    rows_x = (offs_m % M).to(tl.int64)
    w_ptrs = w_ptr + rows_w[:, None] * stride_wn + offs_h[None, :]  # (BLOCK_N, HALF): a tile's bytes
    x_ptrs = x_ptr + rows_x[None, :] * stride_xm + offs_h[:, None]  # (HALF, BLOCK_M), K contiguous
    scale_ptrs = w_scale_ptr + rows_w * stride_sn
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(0, K // BLOCK_K):
        scale = tl.load(scale_ptrs + (k * BLOCK_K) // GROUP_SIZE) if GROUPED else None
        acc = _tile(
            acc, tl.load(w_ptrs), tl.load(x_ptrs), tl.load(x_ptrs + HALF), scale, IS_FP8, GROUPED, ASM, HALF
        )
        w_ptrs += HALF
        x_ptrs += BLOCK_K
    # per channel only (a group size is a multiple of BLOCK_K): the shorter last tile, in its own halves
    rest = K % BLOCK_K
    if rest > 0:
        half = rest // 2
        inside = offs_h < half
        b = tl.load(w_ptrs, mask=inside[None, :], other=0x88)  # two biased zeros
        x_low = tl.load(x_ptrs, mask=inside[:, None], other=0)
        x_high = tl.load(x_ptrs + half, mask=inside[:, None], other=0)
        acc = _tile(acc, b, x_low, x_high, None, IS_FP8, False, ASM, HALF)
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
    widen_asm: bool | None = None,
) -> torch.Tensor:
    """c (M, N) = x @ dequant(w)^T (* x_scale) + bias; x fp8 (with x_scale (M,)) or bf16/fp16 (x_scale None);
    ``block_k`` the K tile the repack laid the weights out in (``ditq.kernels.w4_triton.block_k_for``).
    ``widen_asm``: fp8's widening in PTX (the default on a GPU) or in Triton's arithmetic (False: measured against;
    the interpreter's)."""
    m, k = x.shape
    n = w.shape[0]
    groups = w_scale.shape[1]
    if w.shape[1] * 2 != k or k % groups or (groups > 1 and (k // groups) % block_k):
        raise ValueError(f"w4 GEMM: weight {tuple(w.shape)} with {groups} scale groups does not fit K = {k}")
    is_fp8 = x.dtype == torch.float8_e4m3fn
    if is_fp8 != (x_scale is not None):
        raise ValueError("w4 GEMM: fp8 activations come with their per-token scale, 16-bit ones without")
    asm = is_fp8 and not _interpreted() if widen_asm is None else widen_asm and is_fp8
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
        c.stride(0),
        HAS_BIAS=bias is not None,
        IS_FP8=is_fp8,
        GROUPED=groups > 1,
        ASM=asm,
        BLOCK_K=block_k,
    )
    return c


@triton.jit
def _dequant4_kernel(
    w_ptr, scale_ptr, out_ptr, K, GROUP_SIZE, stride_sn, BLOCK_K: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # k
    mask = offs < K
    start = (offs // BLOCK_K) * BLOCK_K  # the K tile's first k, its length, and where k lies in its halves
    half = tl.minimum(K - start, BLOCK_K) // 2
    j = offs - start
    high = j >= half
    byte = tl.load(w_ptr + row * (K // 2) + start // 2 + tl.where(high, j - half, j), mask=mask, other=0x88)
    q = (tl.where(high, byte >> 4, byte & 0xF).to(tl.int32) - 8).to(tl.float32)
    s = tl.load(scale_ptr + row * stride_sn + offs // GROUP_SIZE, mask=mask, other=0.0)
    tl.store(out_ptr + row * K + offs, (q * s).to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_int4(w: torch.Tensor, w_scale: torch.Tensor, dtype: torch.dtype, block_k: int) -> torch.Tensor:
    """w (N, K // 2) uint8 (the kernels' repack, laid out in halves of ``block_k``) and w_scale (N, G) float32 ->
    (N, K) in ``dtype``: q * scale in float32, one rounding."""
    n, k = w.shape[0], w.shape[1] * 2
    out = torch.empty((n, k), dtype=dtype, device=w.device)
    block = 2048
    _dequant4_kernel[(n, triton.cdiv(k, block))](
        w, w_scale, out, k, k // w_scale.shape[1], w_scale.stride(0), BLOCK_K=block_k, BLOCK=block
    )
    return out
