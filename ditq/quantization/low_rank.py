"""SVDQuant's low-rank branch at quantize time (``--low-rank R``; Li et al., 2024, arXiv:2411.05007): each target's
R largest directions kept in 16 bits, the residual quantized.

W (N, K) ~= U_R S_R V_R^T by a truncated SVD (float32, ``torch.linalg.svd``); the branch is up = U_R sqrt(S_R)
(N, R) and down = sqrt(S_R) V_R^T (R, K), rounded to ``LOW_RANK_DTYPE``, and the residual W - up @ down (float32,
against the rounded branch) is what round to nearest or GPTQ quantizes (GPTQ with the layer's own Hessian: the
branch runs on the same inputs, exactly). How it is stored and read: ``ditq.checkpoint.low_rank``.

SVDQuant puts the branch beside 4-bit weights, whose rounding error the largest directions dominate; at 8 bits the
error is already small, so ``--low-rank`` is refused with the 8-bit and fp8 schemes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ditq.checkpoint.low_rank import LOW_RANK_DOWN, LOW_RANK_DTYPE, LOW_RANK_UP
from ditq.errors import InputError
from ditq.schemes import Scheme

__all__ = ["LowRankSplit", "check_low_rank", "split_low_rank"]


@dataclass(frozen=True)
class LowRankSplit:
    """A weight as its low-rank branch and the residual left to quantize."""

    up: torch.Tensor  # (N, R) LOW_RANK_DTYPE
    down: torch.Tensor  # (R, K) LOW_RANK_DTYPE
    residual: torch.Tensor  # (N, K) float32: W - up @ down

    def tensors(self) -> dict[str, torch.Tensor]:
        """The branch's stored tensors, in file order."""
        return {LOW_RANK_UP: self.up, LOW_RANK_DOWN: self.down}


def check_low_rank(rank: object, schemes: Iterable[Scheme], mixed: bool = False) -> int:
    """``--low-rank``'s value, checked once at the edge: a positive int, with 4-bit schemes only; ``mixed`` (a
    plan's candidates): with at least one 4-bit scheme, whose layers carry the branch (``branch_rank``)."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise InputError(f"--low-rank must be a positive integer (a rank), got {rank!r}")
    schemes = list(schemes)
    wide = sorted({s.name for s in schemes if s.num_bits != 4})
    if mixed and len(wide) == len({s.name for s in schemes}):
        raise InputError(
            f"--low-rank goes with the 4-bit schemes (w4a16, w4a8), as SVDQuant uses it; the candidates "
            f"{', '.join(wide)} hold none"
        )
    if wide and not mixed:
        raise InputError(
            f"--low-rank goes with the 4-bit schemes (w4a16, w4a8), as SVDQuant uses it; not with {wide[0]}"
        )
    return rank


def split_low_rank(weight: torch.Tensor, rank: int) -> LowRankSplit:
    """``weight`` (N, K) as its rank-``rank`` branch and float32 residual (on the weight's device)."""
    w = weight.detach().to(torch.float32)
    u, s, vh = torch.linalg.svd(w, full_matrices=False)  # s descending
    root = s[:rank].sqrt()
    up = (u[:, :rank] * root).to(LOW_RANK_DTYPE)
    down = (root[:, None] * vh[:rank]).to(LOW_RANK_DTYPE)
    residual = w - up.to(torch.float32) @ down.to(torch.float32)
    return LowRankSplit(up.contiguous(), down.contiguous(), residual)
