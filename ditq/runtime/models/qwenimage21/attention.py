"""Quantized attention in Qwen-Image-2.1 (``--attention``): one processor for every attention module, running the
doctor-chosen path (``ditq.doctor.attention.attention_chooser``).

``QuantizedAttnProcessor`` computes what diffusers' ``QwenImage21AttnProcessor`` computes, with its attention
calls replaced: the same Q/K/V projection, norms, RoPE and KV-cache bookkeeping
(``_qwenimage21_prepare_qkv``), then Q and K quantized once per layer and

- prefill (``segments`` given): one call per prefix segment, queries [start, end) over keys [0, end), causal
  from ``start`` for a text segment, and one for the target's queries over every key;
- cached decode (``segments`` None): the target's queries over [cached prefix, target] keys;

padded prompt keys dropped in both (``key_valid``, or the decode's ``attention_mask`` (B, 1, 1, S) it is made
from). Installing it in place of the flex processor too makes the model hand over ``segments``. The doctor chooses
the path; ``ditq.runtime.attention.install_attention`` installs it through this family (``install_attention`` here).
The segments' attention itself is ``ditq.runtime.models.qwenimage21.prefill.quantized_segment_attention``, which a
compiled block's prefill op calls too.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models.transformers.transformer_qwenimage21 import (
    QwenImage21Attention,
    _qwenimage21_prepare_qkv,
)

from ditq.kernels.attention import AttentionPath
from ditq.runtime.models.qwenimage21.fuse import fused_attention_view
from ditq.runtime.models.qwenimage21.prefill import TabulatedPrefillProcessor, quantized_segment_attention

__all__ = ["QuantizedAttnProcessor"]


def _key_valid(attention_mask: Any) -> torch.Tensor | None:
    """The decode's padding mask (B, 1, 1, S_kv) bool as (B, S_kv)."""
    if attention_mask is None:
        return None
    if not (isinstance(attention_mask, torch.Tensor) and attention_mask.dtype == torch.bool
            and attention_mask.ndim == 4 and attention_mask.shape[1:3] == (1, 1)):  # fmt: skip
        raise ValueError(
            f"quantized attention takes a (B, 1, 1, S) bool key mask, got {attention_mask!r:.80}"
        )
    return attention_mask[:, 0, 0]


class QuantizedAttnProcessor(TabulatedPrefillProcessor):
    """``QwenImage21AttnProcessor`` with its attention calls through a quantized-attention path (a compiled
    block's prefill through ``ditq.runtime.models.qwenimage21.prefill.prefill_attention``, with this path)."""

    def __init__(self, path: AttentionPath) -> None:
        self.path = path
        self.attention_path = path.name

    def __call__(
        self, attn: QwenImage21Attention, hidden_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        return super().__call__(fused_attention_view(attn, hidden_states), hidden_states, *args, **kwargs)

    def attend(
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
        query, key, value, _ = _qwenimage21_prepare_qkv(
            attn, hidden_states, rotary_emb, layer_cache, kv_cache_mode, cache_write_slice
        )
        mask = key_valid if segments is not None else _key_valid(attention_mask)
        hidden = quantized_segment_attention(self.path, query, key, value, segments, mask)
        hidden = attn.to_out[0](hidden.flatten(2, 3).type_as(query))
        return attn.to_out[1](hidden)


def attention_modules(transformer: torch.nn.Module) -> list[QwenImage21Attention]:
    """Every attention module of ``transformer``."""
    return [m for m in transformer.modules() if isinstance(m, QwenImage21Attention)]


def install_attention(transformer: torch.nn.Module, path: AttentionPath) -> None:
    """Every attention module of ``transformer`` runs ``path`` from now on (one shared processor)."""
    processor = QuantizedAttnProcessor(path)
    for module in attention_modules(transformer):
        module.set_processor(processor)  # type: ignore[arg-type]
