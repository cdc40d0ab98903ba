"""The Triton paths of the per-token-activation schemes (w8a8: int8, fp8: float8_e4m3fn), registered per scheme.

Each path quantizes the activations per token (``cuda_common.quantize_rows``: outside the GEMM op, so
torch.compile can fuse it into the producer), runs the shared GEMM kernel (``_triton.w8a8_gemm``) on the two
8-bit operands with a float32/int32 accumulator, and applies the per-token x per-channel scales, the bias and the
output cast in the epilogue. Three GEMM variants: pointer loads, TMA tensor descriptors (sm_90) and persistent
TMA (sm_90); each GEMM is a custom op ``ditq::<scheme>_triton[_tma|_persistent]`` on the quantized rows and a
registered kernel path ``triton-<scheme>[-tma|-persistent]``. Triton paths take bf16/fp16 activations (a float32 output tile does not
fit beside the pipeline in shared memory at these tile sizes); float32 activations go to the cuBLAS or reference
paths.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ditq.checkpoint.codecs import codec_for
from ditq.kernels.cuda_common import (
    cuda_op,
    matmul_quantized_rows,
    register_quantized_row_fakes,
    triton_available,
)
from ditq.kernels.registry import HALF_ACTIVATIONS, Prepared, PrepareFn, StoredWeight, register_kernel
from ditq.schemes import Scheme

__all__ = ["prepare_per_channel", "register_per_token_triton"]

# variant -> (op and path suffix, minimum capability (None: the scheme's own), how the GEMM loads its tiles)
_VARIANTS: dict[str, tuple[str, tuple[int, int] | None, str]] = {
    "ptr": ("", None, "GEMM (pointer loads)"),
    "tma": ("tma", (9, 0), "GEMM (TMA tensor descriptors, sm_90)"),
    "persistent": ("persistent", (9, 0), "GEMM, persistent TMA (sm_90)"),
}


def _gemm(variant: str) -> Callable[..., torch.Tensor]:
    from ditq.kernels._triton import w8a8_gemm

    return {
        "ptr": w8a8_gemm.w8a8_gemm,
        "tma": w8a8_gemm.w8a8_gemm_tma,
        "persistent": w8a8_gemm.w8a8_gemm_persistent,
    }[variant]


def _gemm_op(name: str, variant: str) -> Callable[..., torch.Tensor]:
    """Custom op ``name``: x_q (M, K) 8-bit, x_scale (M,) float32 -> GEMM with the scale epilogue -> (M, N) in
    out_dtype."""

    def run(
        x_q: torch.Tensor,
        x_scale: torch.Tensor,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        return _gemm(variant)(x_q, weight, x_scale, weight_scale, bias, out_dtype)

    op = cuda_op(name, run)
    register_quantized_row_fakes(op)
    return op


def prepare_per_channel(scheme: Scheme) -> PrepareFn:
    """The repack of a per-token path of ``scheme``: weight (N, K) as stored (K contiguous); weight_scale (N,)
    float32."""
    codec = codec_for(scheme)

    def prepare(stored: StoredWeight, device: torch.device) -> Prepared:
        q, scale = codec.read(stored)
        return {
            "weight": q.to(device).contiguous(),
            "weight_scale": scale.to(device, torch.float32).reshape(-1).contiguous(),
        }

    return prepare


# The pointer-load GEMM fills the masked K tail of a tile with an integer 0, which Triton cannot cast to fp8 (the
# kernel does not compile: seen on an H200 at K = 4304 and K = 64): its fp8 path takes only in and out features
# that are whole tiles of every configured BLOCK_K (128), where no tail is masked.
_FP8_POINTER_ALIGNMENT = 128


def _alignment(scheme: Scheme, variant: str) -> int:
    return _FP8_POINTER_ALIGNMENT if variant == "ptr" and scheme.activations == "fp8" else 16


def register_per_token_triton(
    scheme: Scheme, priorities: tuple[int, int, int], min_capability: tuple[int, int]
) -> None:
    """Register the pointer, TMA and persistent paths of ``scheme`` (its activations quantized per token);
    ``priorities`` in that order; ``min_capability`` for the pointer path."""
    activation = scheme.activations
    if activation is None:
        raise ValueError(f"{scheme.name} is weight-only: no per-token activation paths")
    prepare = prepare_per_channel(scheme)
    for (variant, (suffix, capability, gemm)), priority in zip(_VARIANTS.items(), priorities, strict=True):
        op = _gemm_op(f"ditq::{scheme.name}_triton" + (f"_{suffix}" if suffix else ""), variant)

        def matmul(
            x: torch.Tensor,
            prepared: Prepared,
            bias: torch.Tensor | None,
            op: Callable[..., torch.Tensor] = op,
            activation: str = activation,
        ) -> torch.Tensor:
            return matmul_quantized_rows(op, x, prepared, bias, activation)

        register_kernel(
            name=f"triton-{scheme.name}" + (f"-{suffix}" if suffix else ""),
            scheme=scheme,
            device_type="cuda",
            prepare=prepare,
            priority=priority,
            min_capability=capability or min_capability,
            activation_dtypes=HALF_ACTIVATIONS,
            alignment=_alignment(scheme, variant),
            available=triton_available,
            description=f"Triton: per-token {activation} quantization kernel + {activation} {gemm} with fused "
            "scale/bias epilogue.",
        )(matmul)
