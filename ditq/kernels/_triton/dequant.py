"""int8 weight dequantization to the activation dtype: w = q * scale (float32 math, one rounding).

q (N, K) int8 row-major, scale (N, G) float32 (G groups of K / G along K) -> w (N, K) in ``dtype``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["dequantize_int8"]


@triton.jit
def _dequant_kernel(q_ptr, scale_ptr, w_ptr, K, GROUP_SIZE, stride_sn, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < K
    q = tl.load(q_ptr + row * K + offs, mask=mask, other=0).to(tl.float32)
    s = tl.load(scale_ptr + row * stride_sn + offs // GROUP_SIZE, mask=mask, other=0.0)
    tl.store(w_ptr + row * K + offs, (q * s).to(w_ptr.dtype.element_ty), mask=mask)


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    n, k = q.shape
    w = torch.empty((n, k), dtype=dtype, device=q.device)
    block = 2048
    _dequant_kernel[(n, triton.cdiv(k, block))](
        q, scale, w, k, k // scale.shape[1], scale.stride(0), BLOCK=block
    )
    return w
