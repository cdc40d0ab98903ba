"""Quantized attention's arithmetic, written once in torch ops: what the CPU path runs, the CUDA fallback runs
on the GPU, and the fused kernels and the doctor are measured against.

Layout (B, S, H, D), as diffusers' attention processors hand it over.

1. Smooth the keys: K - mean over the sequence per (batch, head) (``ditq.numerics.smooth_keys``); every score of
   one query row moves by the same constant, which softmax cancels.
2. Quantize Q and the smoothed K per token (one float32 scale per (batch, token, head)), int8 or fp8 e4m3, with
   ``ditq.numerics.quantize_activation_per_token`` (finer than SageAttention's per-block scales at the same
   kernel cost: one multiply per score either way; and any token slice of a quantized tensor is itself one).
3. S = (Q_q . K_q^T) * scale_q * scale_k * sm_scale in float32 (int8 products summed exactly), masked keys -inf.
4. P = softmax(S) in float32; a row with no allowed key gives zeros.
5. O = P . V with P rounded to V's dtype (bf16 on the GPU), accumulated in float32, cast to V's dtype.

Kind ``int8-fp8`` (SageAttention2's split) quantizes P . V too: Q . K^T as ``int8``, then V per channel (one
float32 scale per (batch, head, dim) over the keys of the call; one per block of keys, tried, made the fused kernel
13 % slower at a 4-reference step for 0.3 dB on the demo model) and P unnormalized (exp(S - row max), at most 1)
times 448, both e4m3; O = (P_q . V_q) * scale_v / sum(448 * P) with the sum over P before its rounding, so
the 448 cancels and only the rounding remains.

Kind ``fp8-fp8`` is what cuDNN's fp8 flash attention computes on Hopper (``ditq.kernels.attention.cudnn``): Q,
the smoothed K and V each in e4m3 with one float32 scale per tensor (its API takes one descale per tensor), P as
``int8-fp8``'s (448 x exp(S - row max) in e4m3, the sum before rounding), and the output written in e4m3 too
(Hopper's cuDNN writes no other), scaled by 1 / (``OUTPUT_HEADROOM`` x V's scale): every output is a convex
combination of V's rows, so it stays under V's largest value and the headroom absorbs P's rounding. e4m3 is a float
format, so one scale per tensor costs precision only where values fall below its normal range (2**-6 of the scale).

Masks are the two that Qwen-Image-2.1's attention uses: ``key_valid`` (B, S_kv) bool (padded prompt tokens are
False) and ``causal_offset`` c (query row i may see keys j <= c + i: a text segment of the block-causal prefix
that starts at c attends to everything before it and causally within itself).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ditq.numerics import FP8_MAX, TINY, quantize_activation_per_token, smooth_keys

__all__ = [
    "ATTENTION_KINDS",
    "FP8_PV_KINDS",
    "OUTPUT_HEADROOM",
    "PER_TENSOR_KINDS",
    "QK_DTYPE",
    "QuantizedQK",
    "allowed_keys",
    "attend_reference",
    "dequantized_values",
    "quantize_per_tensor",
    "quantize_qk_reference",
    "quantize_value_reference",
    "quantized_attention_reference",
    "round_output",
]

ATTENTION_KINDS = ("int8", "fp8", "int8-fp8", "fp8-fp8")
# kind -> the 8-bit dtype of Q . K^T
QK_DTYPE = {"int8": "int8", "fp8": "fp8", "int8-fp8": "int8", "fp8-fp8": "fp8"}
FP8_PV_KINDS = frozenset({"int8-fp8", "fp8-fp8"})  # kinds whose P . V is e4m3 too
PER_TENSOR_KINDS = frozenset({"fp8-fp8"})  # one scale per tensor (Q, K, V, output), the output in e4m3 too
OUTPUT_HEADROOM = 2.0  # fp8-fp8: the output's scale over V's (see above)
_SCORES_PER_CHUNK = 2**26  # float32 scores held at once (256 MiB), so long sequences run in query chunks


@dataclass(frozen=True)
class QuantizedQK:
    """Quantized queries and smoothed keys: query (B, S_q, H, D) and key (B, S_kv, H, D) int8 | float8_e4m3fn,
    their scales (B, S, H, 1) float32 (one per token and head), or (1, 1, 1, 1) for a kind of
    ``PER_TENSOR_KINDS`` (one for the tensor, which any slice of it keeps)."""

    kind: str
    query: torch.Tensor
    query_scale: torch.Tensor
    key: torch.Tensor
    key_scale: torch.Tensor

    def rows(self, start: int, end: int) -> QuantizedQK:
        """Queries [start, end) with every key."""
        return QuantizedQK(self.kind, self.query[:, start:end], _tokens(self.query_scale, start, end), self.key,
                           self.key_scale)  # fmt: skip

    def keys(self, end: int) -> QuantizedQK:
        """Every query with keys [0, end)."""
        return QuantizedQK(
            self.kind, self.query, self.query_scale, self.key[:, :end], _tokens(self.key_scale, 0, end)
        )


def _tokens(scale: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Tokens [start, end) of a per-token scale (B, S, H, 1); a per-tensor one (1, 1, 1, 1) as it is."""
    return scale if scale.shape[1] == 1 and scale.shape[2] == 1 else scale[:, start:end]


def quantize_per_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x to e4m3 with one scale: (q float8_e4m3fn of x's shape, scale (1, 1, 1, 1) float32), scale =
    max(amax, 1e-12) / 448 (``ditq.numerics``' conventions)."""
    xf = x.to(torch.float32)
    scale = xf.abs().amax().clamp_min(TINY).reshape(1, 1, 1, 1) / FP8_MAX
    return (xf / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def quantize_qk_reference(query: torch.Tensor, key: torch.Tensor, kind: str) -> QuantizedQK:
    """Steps 1-2: per-token quantized queries and smoothed keys (B, S, H, D)."""
    if kind not in ATTENTION_KINDS:
        raise ValueError(f"unknown attention kind {kind!r} (known: {', '.join(ATTENTION_KINDS)})")
    if kind in PER_TENSOR_KINDS:
        return QuantizedQK(kind, *quantize_per_tensor(query), *quantize_per_tensor(smooth_keys(key)))
    q, q_scale = quantize_activation_per_token(query, QK_DTYPE[kind])
    k, k_scale = quantize_activation_per_token(smooth_keys(key), QK_DTYPE[kind])
    return QuantizedQK(kind, q, q_scale, k, k_scale)


def quantize_value_reference(
    value: torch.Tensor, kind: str = "int8-fp8"
) -> tuple[torch.Tensor, torch.Tensor]:
    """V (B, S, H, D) per channel to e4m3: (v_q (B, S, H, D) float8_e4m3fn, scale (B, 1, H, D) float32), scale =
    max(amax over S, 1e-12) / 448 (``ditq.numerics``' conventions); for a kind of ``PER_TENSOR_KINDS`` one scale
    for the tensor, (1, 1, 1, 1)."""
    if kind in PER_TENSOR_KINDS:
        return quantize_per_tensor(value)
    v = value.to(torch.float32)
    scale = v.abs().amax(dim=1, keepdim=True).clamp_min(TINY) / FP8_MAX
    return (v / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def dequantized_values(v_q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``quantize_value_reference``'s output back to float32 (B, S, H, D): the values P . V multiplies."""
    return v_q.to(torch.float32) * scale


def round_output(out: torch.Tensor, value_scale: torch.Tensor) -> torch.Tensor:
    """A ``PER_TENSOR_KINDS`` output (float32, any layout) as the kernel writes it: in e4m3 at a scale of
    ``OUTPUT_HEADROOM`` x V's (``value_scale``, (1, 1, 1, 1)), back in float32."""
    scale = (OUTPUT_HEADROOM * value_scale).reshape(())
    return (out / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32) * scale


def allowed_keys(
    key_valid: torch.Tensor | None,
    causal_offset: int | None,
    rows: range,
    keys: int,
    device: torch.device,
) -> torch.Tensor | None:
    """Which keys each query row may see: (B | 1, 1, len(rows), keys) bool, or None for all of them.

    ``rows`` are query indices within the call (for the causal rule, row i sees keys j <= causal_offset + i).
    """
    mask = None
    if causal_offset is not None:
        row = torch.arange(rows.start, rows.stop, device=device)[:, None]
        mask = (torch.arange(keys, device=device)[None, :] <= causal_offset + row)[None, None]
    if key_valid is not None:
        valid = key_valid[:, None, None, :keys].to(device=device, dtype=torch.bool)
        mask = valid if mask is None else mask & valid
    return mask


def attend_reference(
    qk: QuantizedQK,
    value: torch.Tensor,
    key_valid: torch.Tensor | None = None,
    causal_offset: int | None = None,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """Steps 3-5 on quantized Q/K and value (B, S_kv, H, D) -> (B, S_q, H, D) in value's dtype."""
    batch, seq_q, heads, head_dim = qk.query.shape
    seq_kv = qk.key.shape[1]
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    # (B, H, S, D) float32; int8 and e4m3 values are exact in float32, and int8 dot products (< 2**24) too.
    key = qk.key.to(torch.float32).transpose(1, 2)
    key_scale = qk.key_scale.transpose(1, 2).squeeze(-1)  # (B, H, S_kv)
    fp8_pv = qk.kind in FP8_PV_KINDS
    if fp8_pv:
        v_q, v_scale = quantize_value_reference(value, qk.kind)
        v = dequantized_values(v_q, v_scale).transpose(1, 2)
    else:
        v = value.to(torch.float32).transpose(1, 2)
    out = torch.empty(batch, heads, seq_q, head_dim, dtype=torch.float32, device=value.device)
    chunk = max(1, _SCORES_PER_CHUNK // max(1, batch * heads * seq_kv))
    for start in range(0, seq_q, chunk):
        rows = range(start, min(seq_q, start + chunk))
        q = qk.query[:, rows.start : rows.stop].to(torch.float32).transpose(1, 2)
        q_scale = _tokens(qk.query_scale, rows.start, rows.stop).transpose(1, 2)  # (B, H, rows, 1)
        scores = (q @ key.transpose(-1, -2)) * (q_scale * sm_scale) * key_scale[:, :, None, :]
        mask = allowed_keys(key_valid, causal_offset, rows, seq_kv, value.device)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        if fp8_pv:  # P unnormalized x 448 in e4m3, normalized after P . V by the sum before rounding
            p = torch.exp(scores - scores.amax(dim=-1, keepdim=True)).nan_to_num_(0.0) * FP8_MAX
            p_q = p.to(torch.float8_e4m3fn).to(torch.float32)
            total = p.sum(dim=-1, keepdim=True)
            pv = (p_q @ v) / torch.where(total == 0, 1.0, total)
            out[:, :, rows.start : rows.stop] = pv
            continue
        p = torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # a row with no allowed key: zeros
        out[:, :, rows.start : rows.stop] = p.to(value.dtype).to(torch.float32) @ v
    if qk.kind in PER_TENSOR_KINDS:
        out = round_output(out, v_scale)
    return out.transpose(1, 2).to(value.dtype)


def quantized_attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kind: str,
    key_valid: torch.Tensor | None = None,
    causal_offset: int | None = None,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """Steps 1-5: quantized attention of (B, S, H, D) tensors -> (B, S_q, H, D) in value's dtype."""
    return attend_reference(
        quantize_qk_reference(query, key, kind), value, key_valid, causal_offset, sm_scale
    )
