"""SVDQuant's 16-bit low-rank branch (``--low-rank R``) as a checkpoint stores it: two tensors beside a quantized
Linear's own, which compressed-tensors does not read.

A layer of weight W (out, in) quantized with the branch stores

| tensor (``<prefix>.`` + name) | dtype    | shape       | what                               |
| low_rank_up                   | bfloat16 | (out, R)    | U_R * sqrt(S_R), W's R largest directions  |
| low_rank_down                 | bfloat16 | (R, in)     | sqrt(S_R) * V_R^T                  |

and its codec's tensors hold the quantized residual W - up @ down, so the layer's weight is
up @ down + dequant(stored). The branch is bfloat16 whatever the source dtype or the dtype a model was loaded in:
one stored form, so that ``ditq quantize`` and ``ditq.quantize_`` + ``ditq.save`` on a model loaded in float32
write the same bytes, exactly representable in float32 and (at the magnitudes of a weight's singular vectors)
float16 activations. The residual is taken against the rounded branch, so rounding it costs nothing beyond the
residual's own quantization. The names are outside compressed-tensors' (``weight``, ``weight_*``, ``input_*``,
``bias``), which pass any other tensor through as a plain one: a reader that ignores the branch gets the residual
alone, which is not the layer's weight. The manifest names the branch per component (``low_rank_record``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ditq.checkpoint.safetensors_io import TensorEntry
from ditq.errors import InputError
from ditq.schemes import Scheme

__all__ = [
    "LOW_RANK_DOWN",
    "LOW_RANK_DTYPE",
    "LOW_RANK_NAMES",
    "LOW_RANK_UP",
    "branch_rank",
    "check_rank",
    "low_rank_record",
    "low_rank_specs",
    "stored_rank",
]

LOW_RANK_UP = "low_rank_up"  # (out, R)
LOW_RANK_DOWN = "low_rank_down"  # (R, in)
LOW_RANK_NAMES = (LOW_RANK_UP, LOW_RANK_DOWN)  # in file order, after the codec's tensors
LOW_RANK_DTYPE = torch.bfloat16


def branch_rank(scheme: Scheme, rank: int) -> int:
    """The rank of the branch a layer of ``scheme`` carries when ``rank`` is asked for: ``rank`` beside 4-bit
    weights, 0 (none) beside 8-bit ones, whose rounding error is already small (a plan mixes both)."""
    return rank if scheme.num_bits == 4 else 0


def low_rank_specs(
    out_features: int, in_features: int, rank: int
) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The branch's stored tensors -> (dtype, shape), in file order; empty for rank 0 (no branch)."""
    if not rank:
        return {}
    return {
        LOW_RANK_UP: (LOW_RANK_DTYPE, (out_features, rank)),
        LOW_RANK_DOWN: (LOW_RANK_DTYPE, (rank, in_features)),
    }


def check_rank(rank: int, prefix: str, out_features: int, in_features: int) -> None:
    """A rank that leaves a residual to quantize: 1 <= R < min(out, in); else an InputError naming the layer."""
    if rank >= min(out_features, in_features):
        raise InputError(
            f"--low-rank {rank}: {prefix} is ({out_features}, {in_features}); the rank must be below "
            f"{min(out_features, in_features)}"
        )


def stored_rank(prefix: str, entries: Mapping[str, TensorEntry], out_features: int, in_features: int) -> int:
    """The rank of the branch stored beside the quantized Linear at ``prefix`` (0: none), its two tensors checked
    against each other and the layer's shape; a half-stored or misshapen branch is an InputError naming the file."""
    up, down = (entries.get(f"{prefix}.{name}") for name in LOW_RANK_NAMES)
    if up is None and down is None:
        return 0
    where = (up or down).path  # type: ignore[union-attr]
    if up is None or down is None:
        missing = LOW_RANK_UP if up is None else LOW_RANK_DOWN
        raise InputError(f"{where}: {prefix}.{missing} is missing beside its other low-rank tensor")
    rank = up.shape[-1] if len(up.shape) == 2 else -1
    want = low_rank_specs(out_features, in_features, max(rank, 1))
    for entry, name in ((up, LOW_RANK_UP), (down, LOW_RANK_DOWN)):
        if (entry.dtype, tuple(entry.shape)) != want[name]:
            dtype, shape = want[name]
            raise InputError(
                f"{where}: {prefix}.{name} is {entry.dtype} {tuple(entry.shape)}; the low-rank branch of a "
                f"({out_features}, {in_features}) layer is {dtype} {shape}"
            )
    return rank


def low_rank_record(rank: int | None, layers: int) -> dict[str, Any] | None:
    """A component's manifest ``low_rank``: the rank, the tensors' names and dtype, and how many layers carry them
    (every quantized one); None without the branch."""
    if not rank:
        return None
    return {
        "rank": rank,
        "tensors": list(LOW_RANK_NAMES),
        "dtype": str(LOW_RANK_DTYPE).removeprefix("torch."),
        "layers": layers,
        "weight": "low_rank_up @ low_rank_down + dequantized stored weight",
    }
