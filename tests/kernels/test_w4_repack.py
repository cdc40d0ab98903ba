"""The 4-bit CUDA paths' repack, on the CPU: compressed-tensors' biased nibbles laid out in halves of each K tile (a
byte's low nibble in the tile's first half, its high nibble in the second), with no value lost; the K tile each group
size gets."""

from __future__ import annotations

import pytest
import torch

from ditq.checkpoint.codecs import codec_for
from ditq.errors import InputError
from ditq.kernels.w4_triton import block_k_for, repack_int4
from ditq.schemes import W4A8, W4A16


def _widen(packed: torch.Tensor, block_k: int) -> torch.Tensor:
    """What the kernel reads from each K tile of length L (block_k, or a shorter last one), in torch: the low
    nibbles as its first L / 2 values, the high ones as its last, less the bias of 8."""
    values, start = [], 0
    while start < packed.shape[1]:
        half = min(block_k // 2, packed.shape[1] - start)
        tile = packed[:, start : start + half].to(torch.int32)
        values += [(tile & 0xF) - 8, (tile >> 4) - 8]
        start += half
    return torch.cat(values, dim=1)


@pytest.mark.parametrize("scheme", [W4A16, W4A8])
@pytest.mark.parametrize(("n", "k", "groups"), [(48, 256, 2), (32, 96, 1), (8, 1024, 32), (16, 336, 1)])
def test_repack_keeps_every_value_and_scale(scheme: object, n: int, k: int, groups: int) -> None:
    generator = torch.Generator().manual_seed(n + k)
    q = torch.randint(-8, 8, (n, k), generator=generator, dtype=torch.int8)  # -8 too: other tools store it
    scale = torch.rand(n, groups, generator=generator) + 0.1
    stored = codec_for(scheme).encode(q, scale)  # type: ignore[arg-type]
    prepared = repack_int4(stored, torch.device("cpu"))
    assert prepared["weight"].dtype == torch.uint8 and prepared["weight"].shape == (n, k // 2)
    block_k = block_k_for(k, groups)
    assert block_k is not None
    assert torch.equal(_widen(prepared["weight"], block_k), q.to(torch.int32))
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
