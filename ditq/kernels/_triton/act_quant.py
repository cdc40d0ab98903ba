"""Per-token (row) dynamic symmetric activation quantization, one program per row.

x (M, K) bf16/fp16/fp32 -> q (M, K) int8 | float8_e4m3fn, scale (M, 1) float32, with
ditq.numerics' exact conventions: scale = max(amax|x|, 1e-12) / qmax (qmax 127 or 448),
q = round-half-even(x / scale) clamped to [-128, 127] for int8; clamp to +-448 then RTNE cast for fp8.
The division is IEEE round-to-nearest (div_rn), as torch's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["quantize_per_token"]


@triton.jit
def _act_quant_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    K,
    stride_xm,
    stride_qm,
    QMAX: tl.constexpr,
    IS_FP8: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    scale = tl.div_rn(tl.maximum(amax, 1e-12), QMAX)
    y = tl.div_rn(x, scale)
    if IS_FP8:
        y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
        q = y.to(tl.float8e4nv)
    else:
        # Round half to even: adding and subtracting 1.5 * 2**23 leaves an exact integer for |y| < 2**22.
        y = (y + 12582912.0) - 12582912.0
        y = tl.minimum(tl.maximum(y, -128.0), 127.0)
        q = y.to(tl.int8)
    tl.store(q_ptr + row * stride_qm + offs, q, mask=mask)
    tl.store(scale_ptr + row, scale)


def quantize_per_token(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K), last dim contiguous -> (q (M, K), scale (M, 1) float32)."""
    m, k = x.shape
    is_fp8 = kind == "fp8"
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn if is_fp8 else torch.int8, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    block_k = triton.next_power_of_2(k)
    num_warps = 4 if block_k <= 4096 else 8 if block_k <= 16384 else 16
    _act_quant_kernel[(m,)](
        x,
        q,
        scale,
        k,
        x.stride(0),
        q.stride(0),
        QMAX=448.0 if is_fp8 else 127.0,
        IS_FP8=is_fp8,
        BLOCK_K=block_k,
        num_warps=num_warps,
    )
    return q, scale
