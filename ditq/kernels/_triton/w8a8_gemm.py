"""8-bit GEMM with the per-token x per-channel scale epilogue, bias and output cast.

int8 x int8 -> int32 accumulation (w8a8) or float8_e4m3fn x float8_e4m3fn -> float32 (fp8).
a (M, K) 8-bit row-major (quantized activations), b (N, K) 8-bit row-major (the stored
weight, K contiguous: what the tensor cores want for both operands),
scale_a (M,) float32, scale_b (N,) float32, bias (N,) or none ->
c (M, N) = (a @ b^T) * scale_a[:, None] * scale_b[None, :] + bias, in c's dtype.

Three variants of the same function: pointer loads (sm_80+), TMA tensor
descriptors (sm_90+), and a persistent TMA kernel (one program per SM walking
the tiles). Tiles grouped along M for L2 reuse. fp8 partial sums are promoted
to float32 every BLOCK_K (Hopper's fp8 tensor-core accumulator is narrower than
float32; without promotion the all-ones K=4096 case lands 2 % low).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

__all__ = ["w8a8_gemm", "w8a8_gemm_persistent", "w8a8_gemm_tma"]


def _configs() -> list[triton.Config]:
    # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages); int8 tiles: BLOCK_K = 128 bytes per row.
    shapes = [
        (128, 256, 128, 8, 3),
        (128, 128, 128, 8, 4),
        (256, 128, 128, 8, 3),
        (64, 128, 128, 4, 4),
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
    kept = small if m <= 64 else [c for c in configs if c.kwargs["BLOCK_M"] != 64 or m <= 1024]
    return kept or configs


@triton.jit
def _tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def _epilogue(acc, scale_a_ptr, scale_b_ptr, bias_ptr, offs_m, offs_n, M, N, HAS_BIAS: tl.constexpr):
    # acc (BLOCK_M, BLOCK_N) int32 | float32 -> float32 scaled (+ bias)
    scale_a = tl.load(scale_a_ptr + offs_m, mask=offs_m < M, other=0.0)
    scale_b = tl.load(scale_b_ptr + offs_n, mask=offs_n < N, other=0.0)
    c = acc.to(tl.float32) * scale_a[:, None] * scale_b[None, :]
    if HAS_BIAS:
        c += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    return c


@triton.autotune(
    configs=_configs(), key=["M_BUCKET", "N", "K"], prune_configs_by={"early_config_prune": _prune}
)
@triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})
@triton.jit
def _w8a8_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    scale_a_ptr,
    scale_b_ptr,
    bias_ptr,
    M,
    N,
    K,
    M_BUCKET,
    stride_am,
    stride_bn,
    stride_cm,
    HAS_BIAS: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    IS_FP8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows past M / N re-read valid rows (results masked at the store): no masks in the loop.
    rows_a = (offs_m % M).to(tl.int64)
    rows_b = (offs_n % N).to(tl.int64)
    a_ptrs = a_ptr + rows_a[:, None] * stride_am + offs_k[None, :]  # (BLOCK_M, BLOCK_K)
    b_ptrs = b_ptr + rows_b[None, :] * stride_bn + offs_k[:, None]  # (BLOCK_K, BLOCK_N), K contiguous
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC_DTYPE)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0)
        if IS_FP8:
            acc = tl.dot(a, b, acc, out_dtype=ACC_DTYPE, max_num_imprecise_acc=BLOCK_K)
        else:
            acc = tl.dot(a, b, acc, out_dtype=ACC_DTYPE)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    c = _epilogue(acc, scale_a_ptr, scale_b_ptr, bias_ptr, offs_m, offs_n, M, N, HAS_BIAS)
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, c.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def _set_tma_blocks(nargs: dict) -> None:
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["a_desc"].block_shape = [bm, bk]
    nargs["b_desc"].block_shape = [bn, bk]
    nargs["c_desc"].block_shape = [bm, bn]


def _tma_configs() -> list[triton.Config]:
    return [
        triton.Config(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages, pre_hook=_set_tma_blocks)
        for c in _configs()
    ]


@triton.autotune(
    configs=_tma_configs(), key=["M_BUCKET", "N", "K"], prune_configs_by={"early_config_prune": _prune}
)
@triton.jit
def _w8a8_tma_kernel(
    a_desc,
    b_desc,
    c_desc,
    scale_a_ptr,
    scale_b_ptr,
    bias_ptr,
    M,
    N,
    K,
    M_BUCKET,
    HAS_BIAS: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    IS_FP8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC_DTYPE)
    # Out-of-bounds rows / K columns are zero-filled by the copy engine.
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        a = a_desc.load([off_m, k * BLOCK_K])
        b = b_desc.load([off_n, k * BLOCK_K])
        if IS_FP8:
            acc = tl.dot(a, b.T, acc, out_dtype=ACC_DTYPE, max_num_imprecise_acc=BLOCK_K)
        else:
            acc = tl.dot(a, b.T, acc, out_dtype=ACC_DTYPE)
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    c = _epilogue(acc, scale_a_ptr, scale_b_ptr, bias_ptr, offs_m, offs_n, M, N, HAS_BIAS)
    c_desc.store([off_m, off_n], c.to(c_desc.dtype))


def _persistent_configs() -> list[triton.Config]:
    shapes = [(128, 256, 128, 8, 3), (256, 128, 128, 8, 3), (128, 128, 128, 8, 4)]
    if os.environ.get("DITQ_TRITON_AUTOTUNE", "1") == "0":
        shapes = shapes[:1]
    return [
        triton.Config(
            {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8},
            num_warps=w,
            num_stages=st,
            pre_hook=_set_tma_blocks,
        )
        for bm, bn, bk, w, st in shapes
    ]


@triton.autotune(configs=_persistent_configs(), key=["M_BUCKET", "N", "K"])
@triton.jit
def _w8a8_persistent_kernel(
    a_desc,
    b_desc,
    c_desc,
    scale_a_ptr,
    scale_b_ptr,
    bias_ptr,
    M,
    N,
    K,
    M_BUCKET,
    HAS_BIAS: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    IS_FP8: tl.constexpr,
    NUM_SMS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # One program per SM walks tiles start, start + NUM_SMS, ...; the flattened loop lets the
    # compiler overlap one tile's epilogue with the next tile's loads.
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    num_tiles = num_pid_m * num_pid_n
    num_pid_in_group = GROUP_M * num_pid_n
    for tile_id in tl.range(tl.program_id(0), num_tiles, NUM_SMS, flatten=True):
        group_id = tile_id // num_pid_in_group
        first_pid_m = group_id * GROUP_M
        group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
        pid_m = first_pid_m + (tile_id % group_size_m)
        pid_n = (tile_id % num_pid_in_group) // group_size_m
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC_DTYPE)
        for ki in range(k_tiles):
            a = a_desc.load([off_m, ki * BLOCK_K])
            b = b_desc.load([off_n, ki * BLOCK_K])
            if IS_FP8:
                acc = tl.dot(a, b.T, acc, out_dtype=ACC_DTYPE, max_num_imprecise_acc=BLOCK_K)
            else:
                acc = tl.dot(a, b.T, acc, out_dtype=ACC_DTYPE)
        offs_m = off_m + tl.arange(0, BLOCK_M)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        c = _epilogue(acc, scale_a_ptr, scale_b_ptr, bias_ptr, offs_m, offs_n, M, N, HAS_BIAS)
        c_desc.store([off_m, off_n], c.to(c_desc.dtype))


def _acc_dtype(a: torch.Tensor) -> tl.dtype:
    return tl.int32 if a.dtype == torch.int8 else tl.float32


def _bucket(m: int) -> int:
    return min(triton.next_power_of_2(m), 32768)


def w8a8_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Pointer-load variant; see the module docstring for shapes."""
    m, k = a.shape
    n = b.shape[0]
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)

    def grid(meta: dict) -> tuple[int]:
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

    _w8a8_kernel[grid](
        a, b, c, scale_a, scale_b, bias if bias is not None else scale_b,
        m, n, k, _bucket(m), a.stride(0), b.stride(0), c.stride(0),
        HAS_BIAS=bias is not None,
        ACC_DTYPE=_acc_dtype(a),
        IS_FP8=a.dtype != torch.int8,
    )  # fmt: skip
    return c


def w8a8_gemm_tma(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """TMA-descriptor variant (sm_90+); same contract as w8a8_gemm."""
    m, k = a.shape
    n = b.shape[0]
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    # Block shapes are placeholders until the chosen config's pre-hook sets them.
    a_desc = TensorDescriptor.from_tensor(a, [128, 128])
    b_desc = TensorDescriptor.from_tensor(b, [128, 128])
    c_desc = TensorDescriptor.from_tensor(c, [128, 128])

    def grid(meta: dict) -> tuple[int]:
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

    _w8a8_tma_kernel[grid](
        a_desc, b_desc, c_desc, scale_a, scale_b, bias if bias is not None else scale_b,
        m, n, k, _bucket(m),
        HAS_BIAS=bias is not None,
        ACC_DTYPE=_acc_dtype(a),
        IS_FP8=a.dtype != torch.int8,
    )  # fmt: skip
    return c


def w8a8_gemm_persistent(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Persistent TMA variant (sm_90+); same contract as w8a8_gemm."""
    m, k = a.shape
    n = b.shape[0]
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    a_desc = TensorDescriptor.from_tensor(a, [128, 128])
    b_desc = TensorDescriptor.from_tensor(b, [128, 128])
    c_desc = TensorDescriptor.from_tensor(c, [128, 128])
    num_sms = torch.cuda.get_device_properties(a.device).multi_processor_count

    def grid(meta: dict) -> tuple[int]:
        return (min(num_sms, triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"])),)

    _w8a8_persistent_kernel[grid](
        a_desc, b_desc, c_desc, scale_a, scale_b, bias if bias is not None else scale_b,
        m, n, k, _bucket(m),
        HAS_BIAS=bias is not None,
        ACC_DTYPE=_acc_dtype(a),
        IS_FP8=a.dtype != torch.int8,
        NUM_SMS=num_sms,
    )  # fmt: skip
    return c
