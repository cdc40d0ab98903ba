"""Quantized attention through Triton: the ``reference`` module's arithmetic, fused FlashAttention-style.

Two kernels: ``attend`` (kinds int8 and fp8: 8-bit Q . K^T, P . V in V's dtype) and ``attend_pv8`` (kind
int8-fp8: int8 Q . K^T, then P and V in e4m3 for P . V, both on the tensor cores' 8-bit rate; its tiles read through
TMA descriptors, sm_90 and later: 3-5 % faster than pointer loads on an H200, where both were measured).

``quantize_qk``: one pass per tensor, rows of D values (one per (batch, token, head)): keys minus their
precomputed float32 sequence mean (smoothing), then per-row symmetric int8 | fp8 e4m3 with ditq.numerics'
conventions (scale = max(amax, 1e-12) / qmax, IEEE division, round-half-even for int8).

``attend``: one program per (BLOCK_M queries, batch x head). Per key tile:
  S = dot(Q_q (BLOCK_M, D), K_q^T (D, BLOCK_N))  # int8 x int8 -> int32, or e4m3 x e4m3 -> float32
  S = S * (scale_q * sm_scale * log2 e)[:, None] * scale_k[None, :]   (float32, base-2 logits)
masked keys -inf; online softmax in float32 (running max m, running sum l); P (unnormalized, <= 1) cast to
V's dtype; acc += dot(P, V) in float32; O = acc / l (zeros where no key was allowed), cast to V's dtype.
Tensors are (B, S, H, D) with D contiguous; any token slice of them is passed as is.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from ditq.kernels.attention.reference import QK_DTYPE, QuantizedQK
from ditq.numerics import FP8_MAX, TINY

__all__ = ["attend", "attend_pv8", "quantize_qk", "quantize_value"]

_LOG2_E = 1.4426950408889634


@triton.jit
def _quantize_rows_kernel(
    x_ptr,
    mean_ptr,
    q_ptr,
    scale_ptr,
    n_rows,
    seq_len,
    heads,
    QMAX: tl.constexpr,
    IS_FP8: tl.constexpr,
    SMOOTH: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    # x (B, S, H, D) contiguous as n_rows = B*S*H rows of D; mean (B, H, D) float32
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_range = rows < n_rows
    cols = tl.arange(0, HEAD_DIM)
    x = tl.load(x_ptr + rows[:, None] * HEAD_DIM + cols[None, :], mask=in_range[:, None], other=0.0)
    x = x.to(tl.float32)
    if SMOOTH:
        batch_head = (rows // (seq_len * heads)) * heads + rows % heads
        mean = tl.load(
            mean_ptr + batch_head[:, None] * HEAD_DIM + cols[None, :], mask=in_range[:, None], other=0.0
        )
        x = x - mean
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.div_rn(tl.maximum(amax, 1e-12), QMAX)
    y = tl.div_rn(x, scale[:, None])
    if IS_FP8:
        y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
        q = y.to(tl.float8e4nv)
    else:
        # Round half to even: adding and subtracting 1.5 * 2**23 leaves an exact integer for |y| < 2**22.
        y = (y + 12582912.0) - 12582912.0
        q = tl.minimum(tl.maximum(y, -128.0), 127.0).to(tl.int8)
    tl.store(q_ptr + rows[:, None] * HEAD_DIM + cols[None, :], q, mask=in_range[:, None])
    tl.store(scale_ptr + rows, scale, mask=in_range)


def _quantize_rows(
    x: torch.Tensor, kind: str, mean: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (B, S, H, D) -> (q (B, S, H, D) int8 | e4m3, scale (B, S, H, 1) float32); ``mean`` (B, H, D) subtracted
    first when given."""
    x = x.contiguous()
    batch, seq_len, heads, head_dim = x.shape
    is_fp8 = kind == "fp8"
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn if is_fp8 else torch.int8, device=x.device)
    scale = torch.empty((batch, seq_len, heads, 1), dtype=torch.float32, device=x.device)
    n_rows = batch * seq_len * heads
    block_r = 32
    _quantize_rows_kernel[(triton.cdiv(n_rows, block_r),)](
        x,
        x if mean is None else mean.contiguous(),
        q,
        scale,
        n_rows,
        seq_len,
        heads,
        QMAX=448.0 if is_fp8 else 127.0,
        IS_FP8=is_fp8,
        SMOOTH=mean is not None,
        HEAD_DIM=head_dim,
        BLOCK_R=block_r,
        num_warps=4,
    )
    return q, scale


def quantize_qk(query: torch.Tensor, key: torch.Tensor, kind: str) -> QuantizedQK:
    """Per-token quantized queries and smoothed keys, as ``reference.quantize_qk_reference`` computes them."""
    key_mean = key.mean(dim=1, dtype=torch.float32)  # (B, H, D), without a float32 copy of the keys
    q, q_scale = _quantize_rows(query, QK_DTYPE[kind], None)
    k, k_scale = _quantize_rows(key, QK_DTYPE[kind], key_mean)
    return QuantizedQK(kind, q, q_scale, k, k_scale)


@triton.jit
def _attend_tile(
    acc,
    m_i,
    l_i,
    q,
    q_scale,
    k_tile_ptr,
    k_scale_ptr,
    v_tile_ptr,
    valid_ptr,
    start_n,
    offs_m,
    seq_kv,
    causal_offset,
    stride_kn,
    stride_ksn,
    stride_vn,
    stride_valid_n,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    IS_FP8: tl.constexpr,
    CHECK_BOUNDS: tl.constexpr,
    HAS_KEY_VALID: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    if CHECK_BOUNDS:
        in_range = offs_n < seq_kv
        k = tl.load(
            k_tile_ptr + offs_n[:, None] * stride_kn + offs_d[None, :], mask=in_range[:, None], other=0.0
        )
        k_scale = tl.load(k_scale_ptr + offs_n * stride_ksn, mask=in_range, other=0.0)
    else:
        k = tl.load(k_tile_ptr + offs_n[:, None] * stride_kn + offs_d[None, :])
        k_scale = tl.load(k_scale_ptr + offs_n * stride_ksn)
    # (BLOCK_M, D) x (D, BLOCK_N): int8 -> int32 exactly, e4m3 -> float32
    if IS_FP8:  # noqa: SIM108 - a constexpr branch: only one dot is compiled
        s = tl.dot(q, tl.trans(k))
    else:
        s = tl.dot(q, tl.trans(k), out_dtype=tl.int32).to(tl.float32)
    s = s * q_scale[:, None] * k_scale[None, :]
    if CHECK_BOUNDS or HAS_KEY_VALID or IS_CAUSAL:
        allowed = offs_n[None, :] < seq_kv
        if HAS_KEY_VALID:
            key_ok = tl.load(valid_ptr + offs_n * stride_valid_n, mask=offs_n < seq_kv, other=0)
            allowed = allowed & (key_ok[None, :] != 0)
        if IS_CAUSAL:
            allowed = allowed & (offs_n[None, :] <= causal_offset + offs_m[:, None])
        s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no allowed key yet
    alpha = tl.math.exp2(m_i - m_safe)
    p = tl.math.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if CHECK_BOUNDS:
        v = tl.load(
            v_tile_ptr + offs_n[:, None] * stride_vn + offs_d[None, :], mask=in_range[:, None], other=0.0
        )
    else:
        v = tl.load(v_tile_ptr + offs_n[:, None] * stride_vn + offs_d[None, :])
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


_CONFIGS = [
    triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
    for bm, bn, w, s in ((128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2))
]
if os.environ.get("TRITON_INTERPRET") == "1":  # Triton's CPU interpreter cannot time configurations
    _CONFIGS = _CONFIGS[3:4]
elif os.environ.get("DITQ_TRITON_AUTOTUNE", "1") == "0":  # correctness runs: one configuration, no tuning
    _CONFIGS = _CONFIGS[:1]


@triton.autotune(configs=_CONFIGS, key=["HEAD_DIM", "IS_FP8", "size_class"])
@triton.jit
def _attention_kernel(
    q_ptr, q_scale_ptr, k_ptr, k_scale_ptr, v_ptr, valid_ptr, out_ptr,
    stride_qb, stride_qm, stride_qh,
    stride_qsb, stride_qsm, stride_qsh,
    stride_kb, stride_kn, stride_kh,
    stride_ksb, stride_ksn, stride_ksh,
    stride_vb, stride_vn, stride_vh,
    stride_valid_b, stride_valid_n,
    stride_ob, stride_om, stride_oh,
    heads, seq_q, seq_kv, causal_offset, qk_scale, size_class,
    HEAD_DIM: tl.constexpr,
    IS_FP8: tl.constexpr,
    HAS_KEY_VALID: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    batch_head = tl.program_id(1)
    b = (batch_head // heads).to(tl.int64)
    h = (batch_head % heads).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    rows_ok = offs_m < seq_q
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :],
                mask=rows_ok[:, None], other=0.0)  # fmt: skip
    # sm_scale and log2(e) folded into the query scale: exp2 of the result is the softmax numerator
    q_scale = tl.load(
        q_scale_ptr + b * stride_qsb + h * stride_qsh + offs_m * stride_qsm, mask=rows_ok, other=0.0
    )
    q_scale = (q_scale * qk_scale).to(tl.float32)  # float32, also where a caller passes the scale as float64
    k_tile_ptr = k_ptr + b * stride_kb + h * stride_kh
    k_scale_ptr = k_scale_ptr + b * stride_ksb + h * stride_ksh
    v_tile_ptr = v_ptr + b * stride_vb + h * stride_vh
    valid_ptr = valid_ptr + b * stride_valid_b

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    hi = seq_kv
    if IS_CAUSAL:
        hi = tl.minimum(seq_kv, causal_offset + (pid_m + 1) * BLOCK_M)
    full_tiles_end = (hi // BLOCK_N) * BLOCK_N
    for start_n in range(0, full_tiles_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, q_scale, k_tile_ptr, k_scale_ptr, v_tile_ptr, valid_ptr, start_n, offs_m, seq_kv,
            causal_offset, stride_kn, stride_ksn, stride_vn, stride_valid_n,
            BLOCK_N, HEAD_DIM, IS_FP8, False, HAS_KEY_VALID, IS_CAUSAL,
        )  # fmt: skip
    if full_tiles_end < hi:
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, q_scale, k_tile_ptr, k_scale_ptr, v_tile_ptr, valid_ptr, full_tiles_end, offs_m,
            seq_kv, causal_offset, stride_kn, stride_ksn, stride_vn, stride_valid_n,
            BLOCK_N, HEAD_DIM, IS_FP8, True, HAS_KEY_VALID, IS_CAUSAL,
        )  # fmt: skip
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # no allowed key: zeros
    out_ptrs = out_ptr + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=rows_ok[:, None])


def attend(
    qk: QuantizedQK,
    value: torch.Tensor,
    key_valid: torch.Tensor | None,
    causal_offset: int | None,
    sm_scale: float,
) -> torch.Tensor:
    """Fused quantized attention: qk (B, S_q | S_kv, H, D), value (B, S_kv, H, D) -> (B, S_q, H, D) in value's
    dtype."""
    batch, seq_q, heads, head_dim = qk.query.shape
    seq_kv = qk.key.shape[1]
    for name, t in (("query", qk.query), ("key", qk.key), ("value", value)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: the head dim must be contiguous, strides {tuple(t.stride())}")
    out = torch.empty((batch, seq_q, heads, head_dim), dtype=value.dtype, device=value.device)
    valid = None if key_valid is None else key_valid[:, :seq_kv].to(torch.uint8).contiguous()
    valid_strides = (0, 0) if valid is None else (valid.stride(0), valid.stride(1))
    size_class = int(math.log2(max(1, seq_q * seq_kv)) // 4)  # re-tune per 16x in problem size

    def grid(meta: dict) -> tuple[int, int]:
        return (triton.cdiv(seq_q, meta["BLOCK_M"]), batch * heads)

    _attention_kernel[grid](
        qk.query, qk.query_scale, qk.key, qk.key_scale, value, out if valid is None else valid, out,
        qk.query.stride(0), qk.query.stride(1), qk.query.stride(2),
        qk.query_scale.stride(0), qk.query_scale.stride(1), qk.query_scale.stride(2),
        qk.key.stride(0), qk.key.stride(1), qk.key.stride(2),
        qk.key_scale.stride(0), qk.key_scale.stride(1), qk.key_scale.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        *valid_strides,
        out.stride(0), out.stride(1), out.stride(2),
        heads, seq_q, seq_kv, 0 if causal_offset is None else causal_offset, sm_scale * _LOG2_E, size_class,
        HEAD_DIM=head_dim,
        IS_FP8=qk.kind == "fp8",
        HAS_KEY_VALID=valid is not None,
        IS_CAUSAL=causal_offset is not None,
    )  # fmt: skip
    return out


# --- int8-fp8: int8 Q . K^T, e4m3 P . V (SageAttention2's split) ----------------------------------------------


@triton.jit
def _quantize_value_kernel(
    v_ptr, scale_ptr, out_ptr,
    stride_vb, stride_vs, stride_vh,
    heads, seq_len, out_stride_bh,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
):  # fmt: skip
    # v (B, S, H, D), D contiguous; scale (B, H, D) float32; out (B, H, D, S_pad) e4m3, the keys contiguous
    pid_s = tl.program_id(0)
    batch_head = tl.program_id(1)
    b = (batch_head // heads).to(tl.int64)
    h = (batch_head % heads).to(tl.int64)
    offs_s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    in_range = offs_s < seq_len
    x = tl.load(v_ptr + b * stride_vb + h * stride_vh + offs_s[:, None] * stride_vs + offs_d[None, :],
                mask=in_range[:, None], other=0.0).to(tl.float32)  # fmt: skip
    scale = tl.load(scale_ptr + batch_head * HEAD_DIM + offs_d)
    y = tl.div_rn(x, scale[None, :])
    q = tl.minimum(tl.maximum(y, -448.0), 448.0).to(tl.float8e4nv)
    out = out_ptr + batch_head.to(tl.int64) * out_stride_bh + offs_d[None, :] * (out_stride_bh // HEAD_DIM)
    tl.store(out + offs_s[:, None], q, mask=in_range[:, None])


def quantize_value(value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """V (B, S, H, D) per channel to e4m3 as ``reference.quantize_value_reference`` computes it, stored for the
    P . V product: (v_q (B, H, D, S_pad) with the keys contiguous, S_pad a multiple of 16; scale (B, H, D)
    float32)."""
    batch, seq_len, heads, head_dim = value.shape
    if value.stride(-1) != 1:
        raise ValueError(f"value: the head dim must be contiguous, strides {tuple(value.stride())}")
    amax = torch.linalg.vector_norm(value, ord=float("inf"), dim=1, dtype=torch.float32)  # (B, H, D)
    # a tensor divisor: torch on CUDA divides by a Python scalar as a multiply by its reciprocal, not IEEE division
    scale = (amax.clamp_min(TINY) / torch.full_like(amax, FP8_MAX)).contiguous()
    seq_pad = triton.cdiv(seq_len, 16) * 16
    out = torch.empty((batch, heads, head_dim, seq_pad), dtype=torch.float8_e4m3fn, device=value.device)
    block_s = 64
    _quantize_value_kernel[(triton.cdiv(seq_len, block_s), batch * heads)](
        value, scale, out,
        value.stride(0), value.stride(1), value.stride(2),
        heads, seq_len, head_dim * seq_pad,
        HEAD_DIM=head_dim, BLOCK_S=block_s, num_warps=4,
    )  # fmt: skip
    return out, scale


@triton.jit
def _pv8_update(acc, m_i, l_i, s, q_coef, v):  # fmt: skip
    """One key tile's online-softmax step: s (BLOCK_M, BLOCK_N) float32 scores over the row's coefficient (masked
    keys -inf), v (BLOCK_N, D) e4m3 with the keys contiguous (V's scales are applied once, after the last tile)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * q_coef)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no allowed key yet
    alpha = tl.math.exp2(m_i - m_safe)
    # 448 P: log2(448) added to the exponent; the sum carries the same factor, so it cancels in O = acc / l
    p = tl.math.exp2(s * q_coef[:, None] - (m_safe - 8.807354922057604)[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    pv = tl.dot(p.to(tl.float8e4nv), v)  # one tile's sum in float32, then added: no long fp8 accumulation
    return acc * alpha[:, None] + pv, m_new, l_i


@triton.jit
def _pv8_mask(s, offs_m, offs_n, seq_kv, causal_offset, valid_ptr, stride_valid_n,
              HAS_KEY_VALID: tl.constexpr, IS_CAUSAL: tl.constexpr):  # fmt: skip
    allowed = offs_n[None, :] < seq_kv
    if HAS_KEY_VALID:
        key_ok = tl.load(valid_ptr + offs_n * stride_valid_n, mask=offs_n < seq_kv, other=0)
        allowed = allowed & (key_ok[None, :] != 0)
    if IS_CAUSAL:
        allowed = allowed & (offs_n[None, :] <= causal_offset + offs_m[:, None])
    return tl.where(allowed, s, float("-inf"))


@triton.jit
def _pv8_tile(acc, m_i, l_i, s_int, start_n, q_coef, offs_m, k_scale_ptr, stride_ksn, desc_v, batch_head, seq_kv,
              causal_offset, valid_ptr, stride_valid_n, CHECK_BOUNDS: tl.constexpr, HAS_KEY_VALID: tl.constexpr,
              IS_CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):  # fmt: skip
    """The key tile at ``start_n`` given its int32 scores: each key's scale, the mask, V's tile, the softmax step."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    if CHECK_BOUNDS:
        k_scale = tl.load(k_scale_ptr + offs_n * stride_ksn, mask=offs_n < seq_kv, other=0.0)
    else:
        k_scale = tl.load(k_scale_ptr + offs_n * stride_ksn)
    s = s_int.to(tl.float32) * k_scale[None, :]
    if CHECK_BOUNDS or HAS_KEY_VALID or IS_CAUSAL:
        s = _pv8_mask(s, offs_m, offs_n, seq_kv, causal_offset, valid_ptr, stride_valid_n, HAS_KEY_VALID,
                      IS_CAUSAL)  # fmt: skip
    v = tl.trans(desc_v.load([batch_head, 0, start_n]).reshape(HEAD_DIM, BLOCK_N))
    return _pv8_update(acc, m_i, l_i, s, q_coef, v)


def _tma_block_shapes(nargs: dict) -> None:
    """The kernel's TMA descriptors take the configuration's tile shapes (an autotuner pre-hook)."""
    block_m, block_n, head_dim = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["HEAD_DIM"]
    nargs["desc_q"].block_shape = [1, block_m, head_dim]
    nargs["desc_k"].block_shape = [1, block_n, head_dim]
    nargs["desc_v"].block_shape = [1, head_dim, block_n]


_PV8_CONFIGS = [
    triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s, pre_hook=_tma_block_shapes)
    for bm, bn, w, s in ((64, 128, 4, 3), (128, 128, 8, 3), (64, 128, 4, 2), (64, 64, 4, 3))
]  # attention_tune.py's best on an H200 first (benchmarks/results/raw/attention_int8_fp8/)
if os.environ.get("TRITON_INTERPRET") == "1":
    _PV8_CONFIGS = _PV8_CONFIGS[3:]
elif os.environ.get("DITQ_TRITON_AUTOTUNE", "1") == "0":
    _PV8_CONFIGS = _PV8_CONFIGS[:1]


@triton.autotune(configs=_PV8_CONFIGS, key=["HEAD_DIM", "size_class"])
@triton.jit
def _attention_pv8_kernel(
    desc_q, q_scale_ptr, desc_k, k_scale_ptr, desc_v, v_scale_ptr, valid_ptr, out_ptr,
    stride_qsb, stride_qsm, stride_qsh,
    stride_ksb, stride_ksn, stride_ksh,
    stride_valid_b, stride_valid_n,
    stride_ob, stride_om, stride_oh,
    heads, seq_q, seq_kv, causal_offset, qk_scale, size_class,
    HEAD_DIM: tl.constexpr,
    HAS_KEY_VALID: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    # Q (B, S_q, H*D) and K (B, S_kv, H*D) int8 and V (B*H, D, S_pad) e4m3 through TMA descriptors: tiles past a
    # tensor's end arrive as zeros (and the bounds mask makes their scores -inf)
    pid_m = tl.program_id(0)
    batch_head = tl.program_id(1)
    b = batch_head // heads
    h = batch_head % heads
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    rows_ok = offs_m < seq_q
    q = desc_q.load([b, pid_m * BLOCK_M, h * HEAD_DIM]).reshape(BLOCK_M, HEAD_DIM)
    b64 = b.to(tl.int64)
    q_coef = tl.load(q_scale_ptr + b64 * stride_qsb + h * stride_qsh + offs_m * stride_qsm, mask=rows_ok,
                     other=1.0)  # fmt: skip
    q_coef = (q_coef * qk_scale).to(tl.float32)
    k_scale_ptr = k_scale_ptr + b64 * stride_ksb + h * stride_ksh
    valid_ptr = valid_ptr + b64 * stride_valid_b

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    hi = seq_kv
    if IS_CAUSAL:
        hi = tl.minimum(seq_kv, causal_offset + (pid_m + 1) * BLOCK_M)
    full_tiles_end = (hi // BLOCK_N) * BLOCK_N
    for start_n in range(0, full_tiles_end, BLOCK_N):
        k = desc_k.load([b, start_n, h * HEAD_DIM]).reshape(BLOCK_N, HEAD_DIM)
        acc, m_i, l_i = _pv8_tile(
            acc, m_i, l_i, tl.dot(q, tl.trans(k), out_dtype=tl.int32), start_n, q_coef, offs_m, k_scale_ptr,
            stride_ksn, desc_v, batch_head, seq_kv, causal_offset, valid_ptr, stride_valid_n,
            False, HAS_KEY_VALID, IS_CAUSAL, BLOCK_N, HEAD_DIM,
        )  # fmt: skip
    if full_tiles_end < hi:
        k = desc_k.load([b, full_tiles_end, h * HEAD_DIM]).reshape(BLOCK_N, HEAD_DIM)
        acc, m_i, l_i = _pv8_tile(
            acc, m_i, l_i, tl.dot(q, tl.trans(k), out_dtype=tl.int32), full_tiles_end, q_coef, offs_m, k_scale_ptr,
            stride_ksn, desc_v, batch_head, seq_kv, causal_offset, valid_ptr, stride_valid_n,
            True, HAS_KEY_VALID, IS_CAUSAL, BLOCK_N, HEAD_DIM,
        )  # fmt: skip
    v_scale = tl.load(v_scale_ptr + batch_head * HEAD_DIM + offs_d)
    out = acc * v_scale[None, :] / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # no allowed key: zeros
    out_ptrs = out_ptr + b64 * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=rows_ok[:, None])


def attend_pv8(
    qk: QuantizedQK,
    value: torch.Tensor,
    key_valid: torch.Tensor | None,
    causal_offset: int | None,
    sm_scale: float,
    config: dict[str, object] | None = None,
) -> torch.Tensor:
    """int8-fp8 attention: int8 Q . K^T (qk, kind int8-fp8), V quantized here (per channel), e4m3
    P . V -> (B, S_q, H, D) in value's dtype; the tiles read through TMA descriptors (sm_90 and later). ``config``
    (benchmarks/attention_tune.py): one launch configuration (BLOCK_M, BLOCK_N, num_warps, num_stages) instead of
    the tuned ones."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    batch, seq_q, heads, head_dim = qk.query.shape
    seq_kv = qk.key.shape[1]
    for name, t in (("query", qk.query), ("key", qk.key)):
        if t.stride(-1) != 1 or t.stride(-2) != head_dim:
            raise ValueError(f"{name}: each token's heads must be contiguous, strides {tuple(t.stride())}")
    value_t, value_scale = quantize_value(value[:, :seq_kv])
    out = torch.empty((batch, seq_q, heads, head_dim), dtype=value.dtype, device=value.device)
    valid = None if key_valid is None else key_valid[:, :seq_kv].to(torch.uint8).contiguous()
    valid_strides = (0, 0) if valid is None else (valid.stride(0), valid.stride(1))
    size_class = int(math.log2(max(1, seq_q * seq_kv)) // 4)
    # V's rows end at seq_kv, not at their padding (which is never written): keys past it arrive as zeros
    q3, k3, v3 = qk.query.flatten(2), qk.key.flatten(2), value_t.flatten(0, 1)[..., :seq_kv]
    block_m, block_n = (64, 128) if config is None else (config["BLOCK_M"], config["BLOCK_N"])
    descriptors = [
        TensorDescriptor(t, list(t.shape), list(t.stride()), block)
        for t, block in (
            (q3, [1, block_m, head_dim]),
            (k3, [1, block_n, head_dim]),
            (v3, [1, head_dim, block_n]),
        )
    ]  # the autotuner's pre-hook sets each configuration's tile shapes

    def grid(meta: dict) -> tuple[int, int]:
        return (triton.cdiv(seq_q, meta["BLOCK_M"]), batch * heads)

    kernel = _attention_pv8_kernel if config is None else _attention_pv8_kernel.fn
    kernel[grid](
        descriptors[0], qk.query_scale, descriptors[1], qk.key_scale, descriptors[2], value_scale,
        out if valid is None else valid, out,
        qk.query_scale.stride(0), qk.query_scale.stride(1), qk.query_scale.stride(2),
        qk.key_scale.stride(0), qk.key_scale.stride(1), qk.key_scale.stride(2),
        *valid_strides, out.stride(0), out.stride(1), out.stride(2),
        heads, seq_q, seq_kv, 0 if causal_offset is None else causal_offset, sm_scale * _LOG2_E, size_class,
        HEAD_DIM=head_dim, HAS_KEY_VALID=valid is not None, IS_CAUSAL=causal_offset is not None, **(config or {}),
    )  # fmt: skip
    return out
