"""CUDA fp8 (sm_89+) through rowwise ``torch._scaled_mm``: per-token fp8 activation scale x per-channel
weight scale applied by cuBLAS. No custom op: ``torch._scaled_mm`` is an aten op that torch.compile keeps as one
call, and the activation quantization before it (``cuda_common.quantize_rows``) is visible to the compiler, which
fuses it into the activation's producer. Rowwise scaling writes bfloat16 only, so the path takes bfloat16
activations only: a float16 output cast from it would hold bfloat16's precision (the doctor's analytic case at
K = 4304 came back 4320 in float16 on an H200, where float16 holds 4304).

Two paths: ``scaled-mm-fp8`` accumulates in full precision; ``scaled-mm-fp8-fast`` uses cuBLAS's fast accumulation
(``use_fast_accum=True``, as torchao's float8 rowwise does by default), which Hopper's fp8 tensor cores run with a
narrower accumulator: 2 % low on the all-ones K=4096 case and 0.51 % rel-L2 at K=12288 on random data (an H200),
well under the fp8 scheme's own quantization error. It is a candidate only with ``--accumulate fast``, and the doctor
bounds it by that error (``ditq.doctor.checks``), not by the exact paths' rounding bound.
"""

from __future__ import annotations

import torch

from ditq.checkpoint.codecs import codec_for
from ditq.kernels.cuda_common import cuda_available, flatten_rows, quantize_rows
from ditq.kernels.registry import Prepared, StoredWeight, register_kernel
from ditq.schemes import FP8

__all__: list[str] = []


def _prepare(stored: StoredWeight, device: torch.device) -> Prepared:
    """weight float8_e4m3fn (N, K) as stored (its transpose is the column-major B); weight_scale (1, N)."""
    q, scale = codec_for(FP8).read(stored)
    return {
        "weight": q.to(device).contiguous(),
        "weight_scale": scale.to(device, torch.float32).reshape(1, -1).contiguous(),
    }


def _matmul(x: torch.Tensor, prepared: Prepared, bias: torch.Tensor | None, fast_accum: bool) -> torch.Tensor:
    rows = flatten_rows(x)
    x_q, x_scale = quantize_rows(rows, "fp8")  # (M, K) fp8, (M, 1) float32; torch ops under torch.compile
    y = torch._scaled_mm(
        x_q,
        prepared["weight"].t(),
        scale_a=x_scale,
        scale_b=prepared["weight_scale"],
        out_dtype=torch.bfloat16,
        use_fast_accum=fast_accum,
    )
    if bias is not None:
        y = y + bias.to(torch.bfloat16)
    return y.reshape(*x.shape[:-1], y.shape[-1])


_REQUIREMENTS = {
    "scheme": FP8,
    "device_type": "cuda",
    "prepare": _prepare,
    "min_capability": (8, 9),
    "activation_dtypes": frozenset({torch.bfloat16}),
    "alignment": 16,
    "available": cuda_available,
}


@register_kernel(name="scaled-mm-fp8", priority=90, **_REQUIREMENTS)  # type: ignore[arg-type]
def matmul_exact_accum(x: torch.Tensor, prepared: Prepared, bias: torch.Tensor | None) -> torch.Tensor:
    """cuBLAS rowwise torch._scaled_mm, full-precision accumulation."""
    return _matmul(x, prepared, bias, fast_accum=False)


@register_kernel(name="scaled-mm-fp8-fast", priority=95, accumulate="fast", **_REQUIREMENTS)  # type: ignore[arg-type]
def matmul_fast_accum(x: torch.Tensor, prepared: Prepared, bias: torch.Tensor | None) -> torch.Tensor:
    """cuBLAS rowwise torch._scaled_mm, fast accumulation (--accumulate fast)."""
    return _matmul(x, prepared, bias, fast_accum=True)
