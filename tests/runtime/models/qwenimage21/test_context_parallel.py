"""Qwen-Image-2.1's context-parallel pieces that need no second process: each rank's slice of a sequence, the dense
block-causal prefill mask against the rule diffusers states, and the decode mask in the order Ulysses gathers keys.
Two ranks computing together are tested live in ``tests/serve/test_serve_parallel.py``."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.transformers.transformer_qwenimage21 import _qwenimage21_prefix_segments

from ditq.runtime.models.qwenimage21.context_parallel import block_causal_mask, decode_mask, shard_bounds


@pytest.mark.parametrize(("length", "world"), [(9, 2), (10, 2), (11, 4), (3, 4), (64, 8)])
def test_each_rank_slice_is_the_one_tensor_split_gives_it(length: int, world: int) -> None:
    tokens = torch.arange(length)
    assert [tokens[start:end].tolist() for start, end in shard_bounds(length, world)] == [
        piece.tolist() for piece in tokens.tensor_split(world)
    ]


def test_the_prefill_mask_is_the_block_causal_rule() -> None:
    """text (3), a reference (4), text (2), a reference (3), then the target (5), the third text key padded: a query
    sees every key at or before it and its own image block (diffusers' ``build_qwenimage21_block_causal_mask``)."""
    image_ids = torch.tensor([-1] * 3 + [0] * 4 + [-1] * 2 + [1] * 3 + [2] * 5)
    length, prefix_len = len(image_ids), 12
    key_valid = torch.ones(1, length, dtype=torch.bool)
    key_valid[0, 2] = False
    segments = _qwenimage21_prefix_segments(image_ids, prefix_len)
    mask = block_causal_mask(segments, length, key_valid, torch.device("cpu"))
    expected = torch.tensor(
        [
            [
                bool(key_valid[0, k]) and (k <= q or (image_ids[q] >= 0 and image_ids[q] == image_ids[k]))
                for k in range(length)
            ]
            for q in range(length)
        ]
    )
    assert mask.shape == (1, 1, length, length)
    assert torch.equal(mask[0, 0], expected)


def test_the_decode_mask_lists_keys_rank_by_rank_prefix_share_then_target_share() -> None:
    """Prefix 7 and target 4 over 3 ranks: the prefill's joint 11 tokens split [0,4) [4,8) [8,11), so the prefix
    shares are [0,4) [4,7) and none; the decode's target splits [0,2) [2,3) [3,4)."""
    key_index = torch.arange(11).view(1, 1, 1, 11)  # stands in for the mask: which key lands where
    assert decode_mask(key_index, 4, 3).flatten().tolist() == [0, 1, 2, 3, 7, 8, 4, 5, 6, 9, 10]
