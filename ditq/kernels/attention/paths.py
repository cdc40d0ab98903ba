"""The registered quantized-attention paths: the reference arithmetic on the CPU and, as the CUDA fallback, on
the GPU; the fused Triton kernel (``ditq.kernels._triton.attention``) on CUDA for the kinds it computes; cuDNN's fp8
flash attention (``ditq.kernels.attention.cudnn``) for ``fp8-fp8``."""

from __future__ import annotations

import torch

from ditq.kernels.attention.reference import (
    ATTENTION_KINDS,
    FP8_PV_KINDS,
    QuantizedQK,
    attend_reference,
    quantize_qk_reference,
)
from ditq.kernels.attention.registry import register_attention_kernel
from ditq.kernels.cuda_common import cuda_available, cuda_op, direct, triton_available
from ditq.kernels.registry import HALF_ACTIVATIONS

__all__ = ["attend_triton", "quantize_triton"]

_TORCH_DESCRIPTION = (
    "The reference arithmetic in torch ops: float32 scores and softmax in query chunks, then P . V."
)


def quantize_triton(query: torch.Tensor, key: torch.Tensor, kind: str) -> QuantizedQK:
    from ditq.kernels._triton.attention import quantize_qk

    return quantize_qk(query, key, kind)


def _attend_kernel(
    query: torch.Tensor,
    query_scale: torch.Tensor,
    key: torch.Tensor,
    key_scale: torch.Tensor,
    value: torch.Tensor,
    key_valid: torch.Tensor | None,
    causal_offset: int | None,
    sm_scale: float,
    kind: str,
) -> torch.Tensor:
    from ditq.kernels._triton.attention import attend, attend_pv8

    kernel = attend_pv8 if kind in FP8_PV_KINDS else attend
    return kernel(
        QuantizedQK(kind, query, query_scale, key, key_scale), value, key_valid, causal_offset, sm_scale
    )


# One custom op, so that torch.compile keeps each attention call as one opaque call: left to trace the launch,
# dynamo graph-breaks at the TMA descriptors' host-side construction, and inductor compiled the int8 kernel with
# the float scale as float64 (a compile error). Eager calls skip the op's dispatch (``direct``).
_attend_op = cuda_op("ditq::attend_quantized", _attend_kernel)


@_attend_op.register_fake
def _attend_fake(query: torch.Tensor, query_scale: torch.Tensor, key: torch.Tensor, key_scale: torch.Tensor,
                 value: torch.Tensor, key_valid: torch.Tensor | None, causal_offset: int | None, sm_scale: float,
                 kind: str) -> torch.Tensor:  # fmt: skip
    return query.new_empty(query.shape, dtype=value.dtype)


def attend_triton(
    qk: QuantizedQK,
    value: torch.Tensor,
    key_valid: torch.Tensor | None,
    causal_offset: int | None,
    sm_scale: float,
) -> torch.Tensor:
    """Fused Triton kernel for the kind of ``qk``: ``attend`` (8-bit Q . K^T, P . V in V's dtype) or, where P . V is
    8-bit too, ``attend_pv8``."""
    return direct(_attend_op)(
        qk.query, qk.query_scale, qk.key, qk.key_scale, value, key_valid, causal_offset, sm_scale, qk.kind
    )


_TRITON_DESCRIPTIONS = {
    "int8": "Fused Triton kernel: 8-bit Q . K^T, online float32 softmax, P . V in V's dtype.",
    "fp8": "Fused Triton kernel: 8-bit Q . K^T, online float32 softmax, P . V in V's dtype.",
    "int8-fp8": "Fused Triton kernel: int8 Q . K^T, online float32 softmax, e4m3 P . V (V per channel), tiles read "
    "through TMA descriptors.",
}


# Tensor-core int8 needs sm_80, e4m3 sm_89; int8-fp8's kernel reads through TMA descriptors, sm_90.
_TRITON_CAPABILITY = {"int8": (8, 0), "fp8": (8, 9), "int8-fp8": (9, 0)}

for _kind in ATTENTION_KINDS:
    register_attention_kernel(
        name=f"cpu-reference-attention-{_kind}",
        kind=_kind,
        device_type="cpu",
        priority=0,
        quantize=quantize_qk_reference,
        description=_TORCH_DESCRIPTION,
    )(attend_reference)
    register_attention_kernel(
        name=f"cuda-torch-attention-{_kind}",
        kind=_kind,
        device_type="cuda",
        priority=10,
        quantize=quantize_qk_reference,
        available=cuda_available,
        description=_TORCH_DESCRIPTION,
    )(attend_reference)
    if _kind not in _TRITON_CAPABILITY:
        continue
    register_attention_kernel(
        name=f"triton-attention-{_kind}",
        kind=_kind,
        device_type="cuda",
        priority=90,
        quantize=quantize_triton,
        min_capability=_TRITON_CAPABILITY[_kind],
        dtypes=HALF_ACTIVATIONS,
        head_dims=frozenset({32, 64, 128}),
        available=triton_available,
        description=_TRITON_DESCRIPTIONS[_kind],
    )(attend_triton)
