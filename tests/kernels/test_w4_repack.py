"""The 4-bit CUDA paths' repack, on the CPU: compressed-tensors' biased nibbles become two's-complement nibbles, two
to a byte in k order, with no value lost; the K tile each group size gets."""

from __future__ import annotations

import pytest
import torch

from ditq.checkpoint.codecs import codec_for
from ditq.errors import InputError
from ditq.kernels.w4_triton import block_k_for, repack_int4
from ditq.schemes import W4A8, W4A16


def _widen(packed: torch.Tensor) -> torch.Tensor:
    """What the kernel does to a byte, in torch: the low nibble (even k) and the high one (odd k), sign-extended."""
    word = packed.to(torch.int32)
    low, high = (word << 28) >> 28, (word << 24) >> 28
    return torch.stack([low, high], dim=-1).reshape(packed.shape[0], -1)


@pytest.mark.parametrize("scheme", [W4A16, W4A8])
@pytest.mark.parametrize(("n", "k", "groups"), [(48, 256, 2), (32, 96, 1), (8, 1024, 32)])
def test_repack_keeps_every_value_and_scale(scheme: object, n: int, k: int, groups: int) -> None:
    generator = torch.Generator().manual_seed(n + k)
    q = torch.randint(-8, 8, (n, k), generator=generator, dtype=torch.int8)  # -8 too: other tools store it
    scale = torch.rand(n, groups, generator=generator) + 0.1
    stored = codec_for(scheme).encode(q, scale)  # type: ignore[arg-type]
    prepared = repack_int4(stored, torch.device("cpu"))
    assert prepared["weight"].dtype == torch.int8 and prepared["weight"].shape == (n, k // 2)
    assert torch.equal(_widen(prepared["weight"]), q.to(torch.int32))
    assert torch.equal(prepared["weight_scale"], scale)


def test_a_group_no_tile_divides_is_refused_in_one_line() -> None:
    q = torch.zeros(4, 96, dtype=torch.int8)
    stored = codec_for(W4A16).encode(q, torch.ones(4, 4))  # groups of 24
    with pytest.raises(InputError, match="group size 24"):
        repack_int4(stored, torch.device("cpu"))


def test_k_tiles() -> None:
    assert block_k_for(3072, 24) == 128  # groups of 128
    assert block_k_for(1024, 32) == 32  # groups of 32
    assert block_k_for(64, 1) == 64  # per channel, a narrow K: one masked tile
    assert block_k_for(4304, 1) == 128
    assert block_k_for(96, 4) is None
