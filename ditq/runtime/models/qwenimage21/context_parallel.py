"""Qwen-Image-2.1 under diffusers' context parallelism: the plan ``enable_parallelism`` is given, and the attention
processor that makes the block-causal prefill and the prefix KV cache work on a rank's share of the tokens.

diffusers' ``QwenImage21Transformer2DModel`` declares no ``_cp_plan``: its text tokens, reference images and target
image are one interleaved sequence built inside ``forward``, and its processor cuts that sequence into prefix
segments by position, which a rank holding a slice of it cannot do. ``QWENIMAGE21_CP_PLAN`` splits the joint sequence
where Qwen-Image's own plan splits its image and text streams, on the way into the first block (one slice per rank,
``torch.tensor_split``: diffusers' ``ulysses_anything`` sharder, since a prompt's length is anything), splits each
block's and the final norm's modulation mask alike, and gathers the output of ``proj_out``. Every Linear (quantized
ones included) then sees only its rank's tokens; a per-token scheme quantizes each token as one process would.

``ContextParallelAttnProcessor`` computes what diffusers' ``QwenImage21AttnProcessor`` computes, through diffusers'
Ulysses attention (``dispatch_attention_fn`` with the parallel config: all-to-all from tokens to heads, SDPA,
all-to-all back), with

- prefill: one call over the whole sequence with the block-causal mask as a dense (S, S) boolean (a query sees every
  key before it and its own image block; padded prompt keys never), instead of one call per segment;
- the prefix KV cache: each rank keeps the keys and values of its own prefix tokens (the prefix is split as the
  sequence is), and the cached decode attends the target's queries over every rank's [prefix share, target share],
  the padding mask laid out in that order.

The rotary table reaches the processor whole (the plan leaves it), so that each call knows the sequence's length and
takes its rank's rows itself. Ring attention is not used: the native SDPA backend returns no log-sum-exp, and a ring
step cannot apply a mask over keys it does not hold.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from diffusers.models._modeling_parallel import ContextParallelInput, gather_size_by_comm
from diffusers.models.attention_dispatch import AttentionBackendName, dispatch_attention_fn
from diffusers.models.transformers.transformer_qwenimage21 import (
    QwenImage21Attention,
    QwenImage21AttnProcessor,
    _qwenimage21_prepare_qkv,
)

from ditq.runtime.models.qwenimage21.fuse import fused_attention_view

__all__ = [
    "QWENIMAGE21_CP_PLAN",
    "ContextParallelAttnProcessor",
    "block_causal_mask",
    "decode_mask",
    "enable_context_parallel",
    "gather_tokens",
    "shard_bounds",
]

# a forward without prefix segments: one list, so its mask too is built once
_NO_SEGMENTS: list[tuple[int, int, bool]] = []

QWENIMAGE21_CP_PLAN: dict[str, Any] = {
    "transformer_blocks.0": {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3)},
    "transformer_blocks.*": {"target_token_mask": ContextParallelInput(split_dim=0, expected_dims=1)},
    "norm_out": {"target_token_mask": ContextParallelInput(split_dim=0, expected_dims=1)},
}


def shard_bounds(length: int, world: int) -> list[tuple[int, int]]:
    """[start, end) of each rank's slice of ``length`` tokens, as ``torch.tensor_split`` cuts them (the first
    ``length % world`` slices one longer): the slices diffusers' ``ulysses_anything`` sharder hands out."""
    base, extra = divmod(length, world)
    bounds, start = [], 0
    for rank in range(world):
        end = start + base + (1 if rank < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def block_causal_mask(
    segments: list[tuple[int, int, bool]], length: int, key_valid: torch.Tensor | None, device: torch.device
) -> torch.Tensor:
    """Qwen-Image-2.1's prefill mask over ``length`` tokens as (B|1, 1, S, S) bool: a query sees every key at or
    before it and every key of its own image block (``segments``: the prefix's ``(start, end, is_text)`` runs; the
    target image is the block after them); ``key_valid`` (B, S) drops padded prompt keys."""
    block = torch.full((length,), -1, dtype=torch.long, device=device)  # text: -1, no block
    for index, (start, end, is_text) in enumerate(segments):
        if not is_text:
            block[start:end] = index
    block[(segments[-1][1] if segments else 0) :] = len(segments)
    positions = torch.arange(length, device=device)
    earlier = positions[None, :] <= positions[:, None]
    same_block = (block[:, None] == block[None, :]) & (block[:, None] >= 0)
    mask = (earlier | same_block)[None, None]
    return mask if key_valid is None else mask & key_valid.bool()[:, None, None, :]


class ContextParallelAttnProcessor(QwenImage21AttnProcessor):
    """``QwenImage21AttnProcessor`` on this rank's tokens, through diffusers' Ulysses attention.

    One instance serves every attention module of the transformer, so each forward's mask is built once (the model
    hands every block the same ``segments`` list, or in cached decode the same ``attention_mask``) and let go after it
    (``forget``, a hook on the transformer): at 1024x1024 with four references the prefill's is about 20 000^2
    booleans."""

    # SDPA takes the dense mask, flash paths none
    _attention_backend = AttentionBackendName.NATIVE  # type: ignore[assignment]
    _parallel_config = None  # set by ``enable_parallelism``

    def __init__(self) -> None:
        self._mask_key: tuple[Any, ...] | None = None
        self._mask: torch.Tensor | None = None
        self._rank_world: tuple[Any, int, int] | None = None  # (the parallel config read, rank, degree)

    def _rank(self) -> tuple[int, int]:
        """This rank and the degree, read once per parallel config ``enable_parallelism`` sets."""
        config = self._parallel_config
        if self._rank_world is None or self._rank_world[0] is not config:
            assert config is not None, "enable_parallelism sets the parallel config"
            group = config.context_parallel_config._flattened_mesh.get_group()
            self._rank_world = config, dist.get_rank(group), dist.get_world_size(group)
        return self._rank_world[1], self._rank_world[2]

    def _mask_for(self, key: tuple[Any, ...], build: Callable[[], torch.Tensor]) -> torch.Tensor:
        """This forward's mask for ``key`` (the objects the model hands every block alike), built on first use."""
        known = self._mask_key
        if (
            known is None
            or len(known) != len(key)
            or any(a is not b for a, b in zip(known, key, strict=True))
        ):
            self._mask, self._mask_key = build(), key
        assert self._mask is not None
        return self._mask

    def forget(self, *_hook_args: Any) -> None:
        self._mask_key, self._mask = None, None

    def __call__(
        self,
        attn: QwenImage21Attention,
        hidden_states: torch.Tensor,
        attention_mask: Any | None = None,
        rotary_emb: torch.Tensor | None = None,
        layer_cache: Any | None = None,
        kv_cache_mode: str | None = None,
        cache_write_slice: slice | None = None,
        segments: list[tuple[int, int, bool]] | None = None,
        key_valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        assert rotary_emb is not None, "Qwen-Image-2.1 always hands its blocks the rotary table"
        rank, world = self._rank()
        # the whole sequence of this call: the prefill's joint one, or the decode's target
        length = rotary_emb.shape[0]
        start, end = shard_bounds(length, world)[rank]
        attn = fused_attention_view(attn, hidden_states)
        query, key, value, _ = _qwenimage21_prepare_qkv(
            attn, hidden_states, rotary_emb[start:end], None, None, None
        )
        if kv_cache_mode == "cached":
            assert layer_cache is not None
            cached_key, cached_value = layer_cache.get()  # this rank's share of the prefix
            key, value = torch.cat([cached_key, key], dim=1), torch.cat([cached_value, value], dim=1)
            mask = (
                None
                if attention_mask is None
                else self._mask_for((attention_mask,), lambda: decode_mask(attention_mask, length, world))
            )
        else:
            prefix_len = segments[-1][1] if segments else 0
            if kv_cache_mode == "extract" and layer_cache is not None and cache_write_slice is not None:
                mine = max(0, min(end, prefix_len) - start)  # this rank's prefix tokens lead its slice
                layer_cache.store(key[:, :mine].clone(), value[:, :mine].clone())
            joint = _NO_SEGMENTS if segments is None else segments  # one object, so the mask is built once
            mask = self._mask_for(
                (joint, key_valid), lambda: block_causal_mask(joint, length, key_valid, query.device)
            )
        hidden = dispatch_attention_fn(
            query,
            key,
            value,
            attn_mask=mask,
            backend=self._attention_backend,
            parallel_config=self._parallel_config,
        )
        hidden = attn.to_out[0](hidden.flatten(2, 3).type_as(query))
        return attn.to_out[1](hidden)


def decode_mask(attention_mask: torch.Tensor, target_len: int, world: int) -> torch.Tensor:
    """The decode's padding mask (B, 1, 1, prefix + target) in the order Ulysses gathers the keys: rank by rank, its
    prefix share (cut from the prefill's joint sequence, where the prefix leads) then its target share."""
    prefix_len = attention_mask.shape[-1] - target_len
    prefill = shard_bounds(prefix_len + target_len, world)
    target = shard_bounds(target_len, world)
    pieces = []
    for (start, end), (target_start, target_end) in zip(prefill, target, strict=True):
        pieces.append(attention_mask[..., start : max(start, min(end, prefix_len))])
        pieces.append(attention_mask[..., prefix_len + target_start : prefix_len + target_end])
    return torch.cat(pieces, dim=-1)


def gather_tokens(group: dist.ProcessGroup) -> Any:
    """A forward hook that gathers every rank's tokens of a (B, S_rank, C) output along S, in rank order.

    diffusers' own gather for uneven slices (``ContextParallelOutput`` under ``ulysses_anything``) hands
    ``all_gather`` tensors of different lengths, which NCCL takes and gloo refuses ("invalid tensor size"); this one
    pads each slice to the longest, gathers equal tensors, and cuts the padding off again, on either backend."""

    def hook(_module: torch.nn.Module, _args: Any, output: torch.Tensor) -> torch.Tensor:
        sizes = gather_size_by_comm(output.shape[1], group)
        padded = F.pad(output, (0, 0, 0, max(sizes) - output.shape[1])).contiguous()
        pieces = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(pieces, padded, group=group)
        return torch.cat([piece[:, :size] for piece, size in zip(pieces, sizes, strict=True)], dim=1)

    return hook


def enable_context_parallel(transformer: torch.nn.Module, degree: int) -> None:
    """``transformer`` (a Qwen-Image-2.1 DiT) split over ``degree`` ranks of the default process group, through
    diffusers' ``enable_parallelism`` with ``QWENIMAGE21_CP_PLAN`` and Ulysses attention (``ulysses_anything``: any
    sequence length, any head count)."""
    from diffusers.models._modeling_parallel import ContextParallelConfig

    processor = ContextParallelAttnProcessor()
    for block in transformer.transformer_blocks:  # type: ignore[union-attr]
        block.attn.set_processor(processor)
    config = ContextParallelConfig(ulysses_degree=degree, ulysses_anything=True)
    with _one_device_per_host_rank():
        transformer.enable_parallelism(config=config, cp_plan=QWENIMAGE21_CP_PLAN)  # type: ignore[operator]
    group = config._flattened_mesh.get_group()
    transformer.proj_out.register_forward_hook(gather_tokens(group))  # type: ignore[union-attr]
    transformer.register_forward_hook(processor.forget)


@contextmanager
def _one_device_per_host_rank() -> Iterator[None]:
    """diffusers names each rank's device ``(accelerator type, rank % torch.accelerator.device_count())``, which
    divides by zero where torch has no accelerator; on such a host every rank's device is the CPU, as if one."""
    if torch.accelerator.device_count() > 0:
        yield
        return
    with mock.patch.object(torch.accelerator, "device_count", lambda: 1):
        yield
