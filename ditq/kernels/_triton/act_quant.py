"""Per-token (row) dynamic symmetric activation quantization: ROWS rows a program, the row walked in K tiles.

x (M, K) bf16/fp16/fp32 -> q (M, K) int8 | float8_e4m3fn, scale (M, 1) float32, with
ditq.numerics' exact conventions: scale = max(amax|x|, 1e-12) / qmax (qmax 127 or 448),
q = round-half-even(x / scale) clamped to [-128, 127] for int8; clamp to +-448 then RTNE cast for fp8.
The division is IEEE round-to-nearest (div_rn), as torch's.

A row that fits one tile is read once and kept in registers; a longer row is read twice (the amax pass, then
the quantize pass, which finds the program's own rows still in L2). The tile shape (rows a program, tile
width, warps) is tuned per K; every configuration computes the same bits, since amax is order-free and each
element's arithmetic is the same. The first version gave one program a whole row in one power-of-two block
(12288 columns in a 16384 block at 16 warps) and ran at about a third of the copy bandwidth on an H200.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["quantize_per_token"]


# (rows a program, tile width, warps): what the autotuner chooses from, per K
CONFIG_SHAPES = (
    (4, 1024, 4),
    (2, 2048, 4),
    (8, 1024, 8),
    (4, 2048, 8),
    (1, 4096, 4),
    (16, 512, 4),
    (2, 4096, 8),
)


def _configs() -> list[triton.Config]:
    shapes = list(CONFIG_SHAPES)
    if os.environ.get("DITQ_TRITON_AUTOTUNE", "1") == "0":
        shapes = shapes[:1]
    return [triton.Config({"ROWS": r, "BLOCK_K": k}, num_warps=w) for r, k, w in shapes]


@triton.jit
def _quantize_tile(x, scale, QMAX: tl.constexpr, IS_FP8: tl.constexpr):
    y = tl.div_rn(x, scale[:, None])
    if IS_FP8:
        q = tl.minimum(tl.maximum(y, -QMAX), QMAX).to(tl.float8e4nv)
    else:
        # Round half to even: adding and subtracting 1.5 * 2**23 leaves an exact integer for |y| < 2**22.
        y = (y + 12582912.0) - 12582912.0
        q = tl.minimum(tl.maximum(y, -128.0), 127.0).to(tl.int8)
    return q


@triton.autotune(configs=_configs(), key=["K", "IS_FP8"])
@triton.jit
def _act_quant_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    M,
    K,
    stride_xm,
    stride_qm,
    QMAX: tl.constexpr,
    IS_FP8: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < M
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows64[:, None] * stride_xm
    q_rows = q_ptr + rows64[:, None] * stride_qm
    if K <= BLOCK_K:  # one tile: read once
        mask = row_ok[:, None] & (cols < K)[None, :]
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        scale = tl.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12), QMAX)
        tl.store(q_rows + cols[None, :], _quantize_tile(x, scale, QMAX, IS_FP8), mask=mask)
    else:
        amax = tl.zeros([ROWS], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            c = k0 + cols
            mask = row_ok[:, None] & (c < K)[None, :]
            x = tl.load(x_rows + c[None, :], mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
        scale = tl.div_rn(tl.maximum(amax, 1e-12), QMAX)
        for k0 in range(0, K, BLOCK_K):
            c = k0 + cols
            mask = row_ok[:, None] & (c < K)[None, :]
            x = tl.load(x_rows + c[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(q_rows + c[None, :], _quantize_tile(x, scale, QMAX, IS_FP8), mask=mask)
    tl.store(scale_ptr + rows, scale, mask=row_ok)


def quantize_per_token(
    x: torch.Tensor, kind: str, config: tuple[int, int, int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K), last dim contiguous -> (q (M, K), scale (M, 1) float32). ``config``: one of ``CONFIG_SHAPES``
    instead of the tuned choice (for tests: every configuration must give the same bits)."""
    m, k = x.shape
    is_fp8 = kind == "fp8"
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn if is_fp8 else torch.int8, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    args = (x, q, scale, m, k, x.stride(0), q.stride(0))
    qmax = 448.0 if is_fp8 else 127.0
    if config is None:
        _act_quant_kernel[lambda meta: (triton.cdiv(m, meta["ROWS"]),)](*args, QMAX=qmax, IS_FP8=is_fp8)
    else:
        rows, block_k, warps = config
        _act_quant_kernel.fn[(triton.cdiv(m, rows),)](
            *args, QMAX=qmax, IS_FP8=is_fp8, ROWS=rows, BLOCK_K=block_k, num_warps=warps
        )
    return q, scale
