"""What the CUDA paths share: availability checks and per-token activation quantization."""

from __future__ import annotations

import importlib.util

import torch

from ditq.numerics import quantize_activation_per_token

__all__ = ["cuda_available", "flatten_rows", "quantize_rows", "triton_available"]


def cuda_available() -> str | None:
    """None when CUDA can run here, else why not."""
    return None if torch.cuda.is_available() else "CUDA is not available"


def triton_available() -> str | None:
    """None when CUDA and Triton can run here, else why not."""
    if not torch.cuda.is_available():
        return "CUDA is not available"
    return None if importlib.util.find_spec("triton") else "triton is not installed"


def flatten_rows(x: torch.Tensor) -> torch.Tensor:
    """x (..., K) -> (M, K) with a contiguous last dim (a view where possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def quantize_rows(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> (q (M, K) int8|fp8, scale (M, 1) float32): the Triton kernel where Triton is, else eager torch.

    Both follow ditq.numerics' conventions exactly.
    """
    if x.is_cuda and triton_available() is None:
        from ditq.kernels._triton.act_quant import quantize_per_token

        return quantize_per_token(x, kind)
    return quantize_activation_per_token(x, kind)
