"""Quantized attention (8-bit Q . K^T, and P . V for int8-fp8 and fp8-fp8): the arithmetic (``reference``), one
registry of paths (``registry``) and the paths themselves (``paths`` and ``cudnn``; importing this package registers
them)."""

from __future__ import annotations

from ditq.kernels.attention import cudnn, paths
from ditq.kernels.attention.reference import (
    ATTENTION_KINDS,
    FP8_PV_KINDS,
    OUTPUT_HEADROOM,
    PER_TENSOR_KINDS,
    QK_DTYPE,
    QuantizedQK,
    attend_reference,
    dequantized_values,
    quantize_per_tensor,
    quantize_qk_reference,
    quantize_value_reference,
    quantized_attention_reference,
    round_output,
)
from ditq.kernels.attention.registry import (
    ENV_ATTENTION_DISABLE,
    ENV_ATTENTION_FORCE,
    AttentionPath,
    all_attention_kernels,
    candidate_attention_paths,
    get_attention_kernel,
    register_attention_kernel,
    unregister_attention_kernel,
)

__all__ = [
    "ATTENTION_KINDS",
    "ENV_ATTENTION_DISABLE",
    "ENV_ATTENTION_FORCE",
    "FP8_PV_KINDS",
    "OUTPUT_HEADROOM",
    "PER_TENSOR_KINDS",
    "QK_DTYPE",
    "AttentionPath",
    "QuantizedQK",
    "all_attention_kernels",
    "attend_reference",
    "candidate_attention_paths",
    "cudnn",
    "dequantized_values",
    "get_attention_kernel",
    "paths",
    "quantize_per_tensor",
    "quantize_qk_reference",
    "quantize_value_reference",
    "quantized_attention_reference",
    "register_attention_kernel",
    "round_output",
    "unregister_attention_kernel",
]
