"""GPTQ's column sweep on CUDA in Triton, for act order (every column's scale fixed up front).

The sweep in ``gptq._gptq_columns`` quantizes one column at a time: about ten small kernels a column, so a 4096-wide
layer launches some 40 000 of them and its rounding is bound by the launches, not the arithmetic. GPTQ's rows are
independent (a row's errors only move along that row), so here each Triton program takes ``ROWS`` rows and walks a
whole block of columns (``gptq.BLOCK_SIZE``) in order, the rows' block held in registers: one launch per block.
What crosses blocks, the lazy update of the columns after the block (errors @ h_inv[block, after]), stays one
torch matmul, as in the loop. Offsets into the (K, K) factor are 32-bit: ``gptq`` hands it K below 46341 only.

Every operation is the loop's, one rounding each, in the loop's order: q = round_half_even(w / s) clamped, the
error (w - q * s) / d, and the update w - error * h. The divisions are IEEE's (``div_rn``: Triton's ``/`` is an
approximate division on CUDA, which put 0.003-0.06 % of the full-size codes off the loop's on an H100) and the
kernel is compiled without floating-point contraction (``enable_fp_fusion=False``), so that no multiply and
subtract become one fused rounding. On an H100 it gave the loop's codes bit for bit in the GPU test
(``tests/quantization/test_gptq.py``) and at three of the four full-size geometries of
``benchmarks/gptq_rounding.py``; at 4096 x 4096, 14 codes of 16.8 million differed (where, not yet found: the
benchmark now compares the sweeps on one inverse, and each rounding with itself run again).

Imported only when a CUDA calibration rounds: the package imports without Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["sweep_columns"]

ROWS = 16  # rows a program holds: a (16, 128) float32 block is 16 registers a thread at 4 warps


@triton.jit
def _round_half_even(x):
    """torch.round's rounding, exactly: x - floor(x) is exact in float32 for every |x| below 2**23 (larger values
    are integers already, with a zero fraction)."""
    low = tl.floor(x)
    fraction = x - low
    odd = (low - 2.0 * tl.floor(low * 0.5)) == 1.0
    up = (fraction > 0.5) | ((fraction == 0.5) & odd)
    return tl.where(up, low + 1.0, low)


@triton.jit
def _sweep_block(
    w_ptr,  # (N, K) float32: the weights with every earlier block's errors applied; this block's columns are read
    s_ptr,  # (N, K) float32: every column's scale
    h_ptr,  # (K, K) float32: the upper Cholesky factor of H^-1
    q_ptr,  # (N, K) int8 out: the codes
    e_ptr,  # (N, BLOCK_COLS) float32 out: the block's errors, scaled by the diagonal
    n_rows,
    k_cols,
    start,
    count,
    qmax,
    BLOCK_COLS: tl.constexpr,
    ROWS_PER_PROGRAM: tl.constexpr,
):
    rows = (tl.program_id(0) * ROWS_PER_PROGRAM + tl.arange(0, ROWS_PER_PROGRAM)).to(tl.int64)
    cols = tl.arange(0, BLOCK_COLS)
    in_rows = rows < n_rows
    in_cols = cols < count
    block = tl.load(
        w_ptr + rows[:, None] * k_cols + start + cols[None, :],
        mask=in_rows[:, None] & in_cols[None, :],
        other=0.0,
    )
    for i in range(0, count):
        here = (cols == i)[None, :]
        current = tl.sum(tl.where(here, block, 0.0), axis=1)  # column i: one value and zeros, summed exactly
        step = tl.load(s_ptr + rows * k_cols + start + i, mask=in_rows, other=1.0)
        q = tl.minimum(tl.maximum(_round_half_even(tl.math.div_rn(current, step)), -qmax - 1.0), qmax * 1.0)
        diagonal = tl.load(h_ptr + (start + i) * k_cols + start + i)
        error = tl.math.div_rn(current - q * step, diagonal)
        h_row = tl.load(h_ptr + (start + i) * k_cols + start + cols, mask=in_cols & (cols >= i), other=0.0)
        block = block - error[:, None] * h_row[None, :]  # columns before i: h_row is 0 there, nothing changes
        tl.store(q_ptr + rows * k_cols + start + i, q.to(tl.int8), mask=in_rows)
        tl.store(e_ptr + rows * BLOCK_COLS + i, error, mask=in_rows)


def sweep_columns(
    w: torch.Tensor, h_inv: torch.Tensor, qmax: int, column_scale: torch.Tensor, block_size: int
) -> torch.Tensor:
    """``gptq._gptq_columns``' act-order sweep on CUDA: w (N, K) float32, rounded in place with error feedback
    through h_inv (K, K, float32, upper Cholesky factor of H^-1), every column's scale in column_scale (N, K) ->
    q int8 (N, K), in blocks of ``block_size`` columns (a power of two: the kernel's tile)."""
    n, k = w.shape
    if not (w.dtype == torch.float32 and w.is_contiguous()):
        raise ValueError("the Triton GPTQ sweep takes a contiguous float32 weight")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(
            f"the Triton GPTQ sweep takes a block size that is a power of two from 16, not {block_size}"
        )
    h_inv, column_scale = h_inv.contiguous(), column_scale.contiguous()
    q = torch.empty(n, k, dtype=torch.int8, device=w.device)
    if n == 0 or k == 0:
        return q
    errors = torch.empty(n, block_size, dtype=torch.float32, device=w.device)
    grid = (triton.cdiv(n, ROWS),)
    for start in range(0, k, block_size):
        stop = min(start + block_size, k)
        _sweep_block[grid](
            w, column_scale, h_inv, q, errors, n, k, start, stop - start, qmax,
            BLOCK_COLS=block_size, ROWS_PER_PROGRAM=ROWS, enable_fp_fusion=False,
        )  # fmt: skip
        if stop < k:
            w[:, stop:].sub_(errors[:, : stop - start] @ h_inv[start:stop, stop:])
    return q
