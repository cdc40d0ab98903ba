"""Mixed-precision GEMM: bf16/fp16 activations x int8 weights dequantized in registers.

x (M, K) bf16|fp16 row-major, q (N, K) int8 row-major (unpacked stored weight),
scale (N, G) float32 with G = 1 (per channel) or K / GROUP_SIZE (per group),
bias (N,) or none -> y (M, N) in x's dtype.
Per channel: acc += x_tile @ q_tile (q converted to x's dtype: exact for int8),
scale applied once in the epilogue. Per group: q * scale dequantized per element
in registers before the dot.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["w8a16_gemm"]


def _configs() -> list[triton.Config]:
    shapes = [
        (128, 256, 64, 8, 3),
        (128, 128, 64, 8, 4),
        (128, 128, 128, 8, 3),
        (64, 128, 64, 4, 4),
        (64, 64, 128, 4, 4),
    ]
    if os.environ.get("DITQ_TRITON_AUTOTUNE", "1") == "0":
        shapes = shapes[:1]  # correctness runs: one config, no tuning
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=w, num_stages=s)
        for bm, bn, bk, w, s in shapes
    ]


def _prune(configs: list[triton.Config], named_args: dict, **kwargs: object) -> list[triton.Config]:
    m = named_args["M"]
    small = [c for c in configs if c.kwargs["BLOCK_M"] == 64]
    return small if m <= 64 and small else configs


@triton.autotune(
    configs=_configs(),
    key=["M_BUCKET", "N", "K", "GROUP_SIZE"],
    prune_configs_by={"early_config_prune": _prune},
)
@triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})
@triton.jit
def _w8a16_kernel(
    x_ptr,
    q_ptr,
    y_ptr,
    scale_ptr,
    bias_ptr,
    M,
    N,
    K,
    M_BUCKET,
    GROUP_SIZE,
    stride_xm,
    stride_qn,
    stride_ym,
    stride_sn,
    GROUPED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows_x = (offs_m % M).to(tl.int64)
    rows_q = (offs_n % N).to(tl.int64)
    x_ptrs = x_ptr + rows_x[:, None] * stride_xm + offs_k[None, :]  # (BLOCK_M, BLOCK_K)
    q_ptrs = q_ptr + rows_q[None, :] * stride_qn + offs_k[:, None]  # (BLOCK_K, BLOCK_N), K contiguous
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            x = tl.load(x_ptrs)
            q = tl.load(q_ptrs)
        else:
            k_left = K - k * BLOCK_K
            x = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            q = tl.load(q_ptrs, mask=offs_k[:, None] < k_left, other=0)
        if GROUPED:
            groups = (k * BLOCK_K + offs_k) // GROUP_SIZE  # (BLOCK_K,)
            s = tl.load(scale_ptr + rows_q[None, :] * stride_sn + groups[:, None])  # (BLOCK_K, BLOCK_N)
            w = (q.to(tl.float32) * s).to(x.dtype)
        else:
            w = q.to(x.dtype)
        acc = tl.dot(x, w, acc)
        x_ptrs += BLOCK_K
        q_ptrs += BLOCK_K
    if not GROUPED:
        acc = acc * tl.load(scale_ptr + rows_q * stride_sn)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows_q).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def w8a16_gemm(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """See the module docstring for shapes; x's last dim contiguous."""
    m, k = x.shape
    n = q.shape[0]
    n_groups = scale.shape[1]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)

    def grid(meta: dict) -> tuple[int]:
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

    _w8a16_kernel[grid](
        x, q, y, scale, bias if bias is not None else scale,
        m, n, k, min(triton.next_power_of_2(m), 32768), k // n_groups,
        x.stride(0), q.stride(0), y.stride(0), scale.stride(0),
        GROUPED=n_groups > 1,
        HAS_BIAS=bias is not None,
    )  # fmt: skip
    return y
