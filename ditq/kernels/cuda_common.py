"""What the CUDA paths share: availability checks, per-token activation quantization, and the row-op plumbing
(flatten to (M, K), call, reshape back; shape-only fakes for torch.compile).

Each CUDA GEMM is a custom op (``cuda_op``) so that torch.compile traces it as one call; in eager mode the row helpers
call its function directly, since the custom op's Python dispatch costs about as much host time as a DiT-sized
GEMM's device time (``benchmarks/results/kernels_host_overhead_h200_348736e.json``), which leaves the device idle between calls.

The per-token paths quantize the activations *outside* their GEMM op: in eager mode with the Triton kernel, under
torch.compile with ``ditq.numerics``' torch ops, which the compiler sees and fuses into the op that produced the
activation (a norm, modulation or GELU), as it does for torchao's dynamic quantization. The GEMM and its scale
epilogue stay one op either way."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import torch

from ditq.kernels.registry import Prepared
from ditq.numerics import quantize_activation_per_token

__all__ = [
    "cuda_available",
    "cuda_op",
    "direct",
    "flatten_rows",
    "matmul_quantized_rows",
    "matmul_rows",
    "quantize_rows",
    "register_quantized_row_fakes",
    "register_row_fakes",
    "triton_available",
]


def cuda_available() -> str | None:
    """None when CUDA can run here, else why not."""
    return None if torch.cuda.is_available() else "CUDA is not available"


def triton_available() -> str | None:
    """None when CUDA and Triton can run here, else why not."""
    if not torch.cuda.is_available():
        return "CUDA is not available"
    return None if importlib.util.find_spec("triton") else "triton is not installed"


# id of each custom op made by cuda_op -> the function it wraps (ops live as long as their modules)
_EAGER_FUNCTIONS: dict[int, Callable[..., torch.Tensor]] = {}


def cuda_op(name: str, fn: Callable[..., torch.Tensor], device_types: str | None = "cuda") -> Any:
    """``fn`` as the custom op ``name`` (no mutation) for ``device_types`` (None: every device); the row helpers
    below call ``fn`` itself outside torch.compile."""
    op = torch.library.custom_op(name, mutates_args=(), device_types=device_types)(fn)
    _EAGER_FUNCTIONS[id(op)] = fn
    return op


def direct(op: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The op under torch.compile; its function otherwise (the same arithmetic without the dispatch)."""
    if torch.compiler.is_compiling():
        return op
    return _EAGER_FUNCTIONS.get(id(op), op)


def flatten_rows(x: torch.Tensor) -> torch.Tensor:
    """x (..., K) -> (M, K) with a contiguous last dim (a view where possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def matmul_rows(
    op: Callable[..., torch.Tensor], x: torch.Tensor, prepared: Prepared, bias: torch.Tensor | None
) -> torch.Tensor:
    """x (..., K) through a row op (x (M, K), weight, weight_scale, bias) -> (M, N), reshaped to (..., N)."""
    y = direct(op)(flatten_rows(x), prepared["weight"], prepared["weight_scale"], bias)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def matmul_quantized_rows(
    op: Callable[..., torch.Tensor], x: torch.Tensor, prepared: Prepared, bias: torch.Tensor | None, kind: str
) -> torch.Tensor:
    """x (..., K): per-token ``kind`` quantization (``quantize_rows``), then a GEMM op on the quantized rows
    (x_q (M, K), x_scale (M,), weight, weight_scale, bias, out_dtype) -> (M, N), reshaped to (..., N)."""
    rows = flatten_rows(x)
    x_q, x_scale = quantize_rows(rows, kind)  # (M, K) 8-bit, (M, 1) float32
    y = direct(op)(x_q, x_scale.reshape(-1), prepared["weight"], prepared["weight_scale"], bias, rows.dtype)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _rows_out(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


def register_row_fakes(*ops: Any) -> None:
    """Shape-only implementations for row ops (x (M, K), weight (N, K), weight_scale, bias) -> (M, N), so
    torch.compile traces through them."""
    for op in ops:
        op.register_fake(_rows_out)


def _quantized_rows_out(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return x_q.new_empty((x_q.shape[0], weight.shape[0]), dtype=out_dtype)


def register_quantized_row_fakes(*ops: Any) -> None:
    """Shape-only implementations for GEMM ops on quantized rows (x_q (M, K), x_scale (M,), weight (N, K),
    weight_scale, bias, out_dtype) -> (M, N) in out_dtype, so torch.compile traces through them."""
    for op in ops:
        op.register_fake(_quantized_rows_out)


def quantize_rows(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> (q (M, K) int8|fp8, scale (M, 1) float32): the Triton kernel where Triton is (eager), else
    torch ops; under torch.compile always torch ops, so the compiler can fuse them into x's producer.

    Both follow ditq.numerics' conventions (torch on CUDA divides by the scalar qmax as a multiply by its
    reciprocal, so a scale may differ from the Triton kernel's IEEE division by one float32 ulp).
    """
    # is_compiling first: dynamo must not trace triton_available's import lookup (a graph break)
    if not torch.compiler.is_compiling() and x.is_cuda and triton_available() is None:
        from ditq.kernels._triton.act_quant import quantize_per_token

        return quantize_per_token(x, kind)
    return quantize_activation_per_token(x, kind)
