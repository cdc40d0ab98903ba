"""CUDA w8a16: a Triton mixed-precision GEMM (int8 weights converted in registers, scale in the epilogue)
and dequantize + cuBLAS GEMM (ops ``ditq::w8a16_triton``, ``ditq::w8a16_dequant_matmul``).

Dequantize + cuBLAS is preferred: at DiT token counts (M >= 4096) it ran at 0.91-0.94x BF16 on an
H200, the Triton kernel at 0.56-0.64x (benchmarks/results/kernels_bench_h200_348736e.json).
"""

from __future__ import annotations

import torch

from ditq.checkpoint.codecs import codec_for
from ditq.kernels.cuda_common import cuda_op, matmul_rows, register_row_fakes, triton_available
from ditq.kernels.registry import HALF_ACTIVATIONS, Prepared, StoredWeight, register_kernel
from ditq.schemes import W8A16

__all__: list[str] = []


def _prepare(stored: StoredWeight, device: torch.device) -> Prepared:
    """Repack: the stored int32 words (4 biased bytes each) -> int8 (N, K); weight_scale (N, G) float32."""
    q, scale = codec_for(W8A16).read({key: t.to(device) for key, t in stored.items()})
    return {"weight": q.contiguous(), "weight_scale": scale.to(torch.float32).contiguous()}


def _w8a16_triton(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    from ditq.kernels._triton.w8a16_gemm import w8a16_gemm

    return w8a16_gemm(x, weight, weight_scale, bias)


def _w8a16_dequant_matmul(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    from ditq.kernels._triton.dequant import dequantize_int8

    w = dequantize_int8(weight, weight_scale, x.dtype)  # (N, K) in x's dtype, transient
    return torch.nn.functional.linear(x, w, bias)


w8a16_triton = cuda_op("ditq::w8a16_triton", _w8a16_triton)
w8a16_dequant_matmul = cuda_op("ditq::w8a16_dequant_matmul", _w8a16_dequant_matmul)
register_row_fakes(w8a16_triton, w8a16_dequant_matmul)


@register_kernel(
    name="triton-w8a16",
    scheme=W8A16,
    device_type="cuda",
    prepare=_prepare,
    priority=80,
    min_capability=(8, 0),
    activation_dtypes=HALF_ACTIVATIONS,
    alignment=16,
    available=triton_available,
)
def matmul_triton(x: torch.Tensor, prepared: Prepared, bias: torch.Tensor | None) -> torch.Tensor:
    """Triton mixed-precision GEMM: int8 weights converted in registers, per-channel scale in the epilogue."""
    return matmul_rows(w8a16_triton, x, prepared, bias)


@register_kernel(
    name="dequant-matmul-w8a16",
    scheme=W8A16,
    device_type="cuda",
    prepare=_prepare,
    priority=85,
    min_capability=(8, 0),
    activation_dtypes=HALF_ACTIVATIONS | {torch.float32},
    alignment=16,
    available=triton_available,
)
def matmul_dequant(x: torch.Tensor, prepared: Prepared, bias: torch.Tensor | None) -> torch.Tensor:
    """Dequantize to the activation dtype (Triton), then a cuBLAS GEMM."""
    return matmul_rows(w8a16_dequant_matmul, x, prepared, bias)
