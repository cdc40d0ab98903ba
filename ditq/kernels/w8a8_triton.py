"""CUDA w8a8 through Triton: per-token int8 activation quantization, int8 x int8 -> int32 GEMM,
per-token x per-channel scale epilogue with bias and the output cast fused (ops ``ditq::w8a8_triton*``).
Triton paths take bf16/fp16 activations (a float32 output tile does not fit beside the pipeline in
shared memory at these tile sizes); float32 activations go to the cuBLAS or reference paths.
"""

from __future__ import annotations

import torch

from ditq.kernels.cuda_common import flatten_rows, quantize_rows, triton_available
from ditq.kernels.registry import HALF_ACTIVATIONS, Prepared, StoredWeight, register_kernel
from ditq.kernels.stored import stored_int8_weight

__all__ = ["prepare_w8a8"]


def prepare_w8a8(stored: StoredWeight, device: torch.device) -> Prepared:
    """weight int8 (N, K) as stored (K contiguous); weight_scale (N,) float32."""
    q, scale = stored_int8_weight(stored)
    return {
        "weight": q.to(device).contiguous(),
        "weight_scale": scale.to(device, torch.float32).reshape(-1).contiguous(),
    }


def _run(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None, variant: str
) -> torch.Tensor:
    from ditq.kernels._triton import w8a8_gemm

    x_q, x_scale = quantize_rows(x, "int8")  # (M, K) int8, (M, 1) float32
    gemm = {
        "ptr": w8a8_gemm.w8a8_gemm,
        "tma": w8a8_gemm.w8a8_gemm_tma,
        "persistent": w8a8_gemm.w8a8_gemm_persistent,
    }[variant]
    return gemm(x_q, weight, x_scale.reshape(-1), weight_scale, bias, x.dtype)


@torch.library.custom_op("ditq::w8a8_triton", mutates_args=(), device_types="cuda")
def w8a8_triton(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return _run(x, weight, weight_scale, bias, variant="ptr")


@torch.library.custom_op("ditq::w8a8_triton_tma", mutates_args=(), device_types="cuda")
def w8a8_triton_tma(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return _run(x, weight, weight_scale, bias, variant="tma")


@torch.library.custom_op("ditq::w8a8_triton_persistent", mutates_args=(), device_types="cuda")
def w8a8_triton_persistent(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return _run(x, weight, weight_scale, bias, variant="persistent")


for _op in (w8a8_triton, w8a8_triton_tma, w8a8_triton_persistent):

    @_op.register_fake
    def _fake(
        x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return x.new_empty((x.shape[0], weight.shape[0]))


@register_kernel(
    name="triton-w8a8",
    scheme="w8a8",
    device_type="cuda",
    prepare=prepare_w8a8,
    priority=80,
    min_capability=(8, 0),
    activation_dtypes=HALF_ACTIVATIONS,
    alignment=16,
    available=triton_available,
)
def matmul_triton(x: torch.Tensor, prepared: Prepared, bias: torch.Tensor | None) -> torch.Tensor:
    """Triton: per-token int8 quantization kernel + int8 GEMM (pointer loads) with fused scale/bias epilogue."""
    y = w8a8_triton(flatten_rows(x), prepared["weight"], prepared["weight_scale"], bias)
    return y.reshape(*x.shape[:-1], y.shape[-1])


@register_kernel(
    name="triton-w8a8-tma",
    scheme="w8a8",
    device_type="cuda",
    prepare=prepare_w8a8,
    priority=90,
    min_capability=(9, 0),
    activation_dtypes=HALF_ACTIVATIONS,
    alignment=16,
    available=triton_available,
)
def matmul_triton_tma(x: torch.Tensor, prepared: Prepared, bias: torch.Tensor | None) -> torch.Tensor:
    """Triton: per-token int8 quantization kernel + int8 GEMM (TMA tensor descriptors, sm_90) with fused epilogue."""
    y = w8a8_triton_tma(flatten_rows(x), prepared["weight"], prepared["weight_scale"], bias)
    return y.reshape(*x.shape[:-1], y.shape[-1])


@register_kernel(
    name="triton-w8a8-persistent",
    scheme="w8a8",
    device_type="cuda",
    prepare=prepare_w8a8,
    priority=95,
    min_capability=(9, 0),
    activation_dtypes=HALF_ACTIVATIONS,
    alignment=16,
    available=triton_available,
)
def matmul_triton_persistent(x: torch.Tensor, prepared: Prepared, bias: torch.Tensor | None) -> torch.Tensor:
    """Triton: per-token int8 quantization kernel + persistent TMA int8 GEMM (sm_90) with fused epilogue."""
    y = w8a8_triton_persistent(flatten_rows(x), prepared["weight"], prepared["weight_scale"], bias)
    return y.reshape(*x.shape[:-1], y.shape[-1])
