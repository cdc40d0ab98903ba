"""CPU reference paths: exactly the stored math, in float32 (what CI runs, and what the doctor trusts).

w8a16, w4a16: y = x @ dequant(q, s)^T + b
w8a8 / fp8 / w4a8: (x_q, s_x) = quantize_activation_per_token(x); y = (x_q * s_x) @ (q * s_w)^T + b
(w4a8's activations are fp8; its weights' groups are dequantized before the GEMM, which in float32 is the same
sum as scaling each group's partial sum.)
All arithmetic in float32, cast to x.dtype at the end. Each is a torch custom
op (``ditq::*_reference``) so torch.compile traces a model through it.
"""

from __future__ import annotations

import torch

from ditq.checkpoint.codecs import codec_for
from ditq.kernels.registry import Prepared, PrepareFn, StoredWeight, register_kernel
from ditq.numerics import dequantize_weight, quantize_activation_per_token
from ditq.schemes import FP8, W4A8, W4A16, W8A8, W8A16, Scheme

__all__ = ["reference_float32"]


def reference_float32(
    x: torch.Tensor,
    q: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    activations: str | None,
) -> torch.Tensor:
    """The float32 reference output (..., N) for x (..., K), on x's device.

    ``activations`` None (weight-only), "int8" or "fp8" (per-token quantized, numerics' conventions).
    """
    w = dequantize_weight(q, weight_scale, torch.float32)  # (N, K)
    if activations is None:
        xf = x.to(torch.float32)
    else:
        x_q, x_scale = quantize_activation_per_token(x, activations)
        xf = x_q.to(torch.float32) * x_scale
    y = xf @ w.t()
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y


def _out_shape(x: torch.Tensor, q: torch.Tensor) -> list[int]:
    return [*x.shape[:-1], q.shape[0]]


@torch.library.custom_op("ditq::w8a16_reference", mutates_args=())
def w8a16_reference(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return reference_float32(x, weight, weight_scale, bias, None).to(x.dtype)


@torch.library.custom_op("ditq::w8a8_reference", mutates_args=())
def w8a8_reference(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return reference_float32(x, weight, weight_scale, bias, "int8").to(x.dtype)


@torch.library.custom_op("ditq::fp8_reference", mutates_args=())
def fp8_reference(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return reference_float32(x, weight, weight_scale, bias, "fp8").to(x.dtype)


for _op in (w8a16_reference, w8a8_reference, fp8_reference):

    @_op.register_fake
    def _fake(
        x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return x.new_empty(_out_shape(x, weight))


def _prepare_for(scheme: Scheme) -> PrepareFn:
    """The reference repack: weight q (N, K) int8|fp8 and weight_scale (N, 1|groups) float32, as the codec reads them."""
    codec = codec_for(scheme)

    def prepare(stored: StoredWeight, device: torch.device) -> Prepared:
        q, scale = codec.read(stored)
        return {
            "weight": q.to(device).contiguous(),
            "weight_scale": scale.to(device, torch.float32).contiguous(),
        }

    return prepare


@register_kernel(
    name="cpu-reference-w8a16", scheme=W8A16, device_type="cpu", prepare=_prepare_for(W8A16), priority=0
)
def matmul_w8a16(x: torch.Tensor, prepared: Prepared, bias: torch.Tensor | None) -> torch.Tensor:
    """Reference: dequantize (unpacked int8 x scale) in float32, float32 GEMM."""
    return w8a16_reference(x, prepared["weight"], prepared["weight_scale"], bias)


@register_kernel(
    name="cpu-reference-w8a8", scheme=W8A8, device_type="cpu", prepare=_prepare_for(W8A8), priority=0
)
def matmul_w8a8(x: torch.Tensor, prepared: Prepared, bias: torch.Tensor | None) -> torch.Tensor:
    """Reference: per-token int8 activation quantization, dequantized float32 GEMM."""
    return w8a8_reference(x, prepared["weight"], prepared["weight_scale"], bias)


@register_kernel(
    name="cpu-reference-fp8", scheme=FP8, device_type="cpu", prepare=_prepare_for(FP8), priority=0
)
def matmul_fp8(x: torch.Tensor, prepared: Prepared, bias: torch.Tensor | None) -> torch.Tensor:
    """Reference: per-token fp8 activation quantization, dequantized float32 GEMM."""
    return fp8_reference(x, prepared["weight"], prepared["weight_scale"], bias)


@register_kernel(
    name="cpu-reference-w4a16", scheme=W4A16, device_type="cpu", prepare=_prepare_for(W4A16), priority=0
)
def matmul_w4a16(x: torch.Tensor, prepared: Prepared, bias: torch.Tensor | None) -> torch.Tensor:
    """Reference: dequantize (unpacked int4 x group scale) in float32, float32 GEMM."""
    return w8a16_reference(x, prepared["weight"], prepared["weight_scale"], bias)


@register_kernel(
    name="cpu-reference-w4a8", scheme=W4A8, device_type="cpu", prepare=_prepare_for(W4A8), priority=0
)
def matmul_w4a8(x: torch.Tensor, prepared: Prepared, bias: torch.Tensor | None) -> torch.Tensor:
    """Reference: per-token fp8 activation quantization, dequantized (int4 x group scale) float32 GEMM."""
    return fp8_reference(x, prepared["weight"], prepared["weight_scale"], bias)
