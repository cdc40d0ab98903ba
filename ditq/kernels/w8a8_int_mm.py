"""CUDA w8a8 through cuBLAS ``torch._int_mm``: per-token int8 quantization (``cuda_common.quantize_rows``, outside
the op so torch.compile can fuse it into the producer), then (M, K) int8 @ (K, N) int8 -> int32 and the scale
epilogue in eager torch (op ``ditq::w8a8_int_mm``).
"""

from __future__ import annotations

import torch

from ditq.kernels.cuda_common import (
    cuda_available,
    cuda_op,
    matmul_quantized_rows,
    register_quantized_row_fakes,
)
from ditq.kernels.per_token_triton import prepare_per_channel
from ditq.kernels.registry import FLOAT_ACTIVATIONS, Prepared, register_kernel
from ditq.schemes import W8A8

__all__: list[str] = []

_MIN_ROWS = 17  # torch._int_mm needs M > 16


def _w8a8_int_mm(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    m = x_q.shape[0]
    if m < _MIN_ROWS:
        x_q = torch.nn.functional.pad(x_q, (0, 0, 0, 32 - m))
    acc = torch._int_mm(x_q, weight.t())[:m]  # (M, K) @ (K, N) column-major -> (M, N) int32
    y = acc.to(torch.float32).mul_(x_scale[:, None]).mul_(weight_scale)
    if bias is not None:
        y.add_(bias.to(torch.float32))
    return y.to(out_dtype)


w8a8_int_mm = cuda_op("ditq::w8a8_int_mm", _w8a8_int_mm)
register_quantized_row_fakes(w8a8_int_mm)


@register_kernel(
    name="int-mm-w8a8",
    scheme=W8A8,
    device_type="cuda",
    prepare=prepare_per_channel(W8A8),
    priority=50,
    min_capability=(8, 0),
    activation_dtypes=FLOAT_ACTIVATIONS,
    alignment=16,
    available=cuda_available,
)
def matmul_int_mm(x: torch.Tensor, prepared: Prepared, bias: torch.Tensor | None) -> torch.Tensor:
    """cuBLAS torch._int_mm with per-token quantization and an eager scale epilogue."""
    return matmul_quantized_rows(w8a8_int_mm, x, prepared, bias, "int8")
