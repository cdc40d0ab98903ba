"""The prefill's block-causal attention as one custom op (``ditq::prefill_attention``), so that a compiled block
serves every reference count with one graph.

Qwen-Image-2.1's prefill attends segment by segment: the model hands every block the prefix's ``(start, end,
is_text)`` runs (``segments``: one for the prompt, two more per reference), and the processor makes one attention
call per run. Under torch.compile dynamo unrolls that loop and guards on its length, so the prefix step compiled
once per reference count: a served warm-up compiled six graphs (the cached step's and five prefix steps') where
two do.

Here the segments reach a compiled block as a table (``segment_table``: a flat int64 tensor on the host, whose
length is a dynamic size and whose values dynamo does not guard), and the loop runs inside one op that the
compiler keeps as one call. The op computes what diffusers' ``QwenImage21AttnProcessor`` computes, by calling it
over queries, keys and values already projected, normalised and rotated; with a quantized-attention path, what
``quantized_segment_attention`` (here, beside the op, so that ``attention``'s processor and the op share it without
an import loop) computes. Only the attention leaves the graph: the projections, norms, RoPE and the KV cache's
bookkeeping around it stay compiled.

Eager code never sees a table: ``ditq.runtime.compile`` has this family make one for a compiled block
(``QwenImage21.compiled_block_arguments``) only where the block's processor takes it (``takes_segment_table``).
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models.transformers.transformer_qwenimage21 import (
    QwenImage21Attention,
    QwenImage21AttnProcessor,
    _qwenimage21_prepare_qkv,
)

from ditq.kernels.attention import AttentionPath, get_attention_kernel

__all__ = [
    "TabulatedPrefillProcessor",
    "prefill_attention",
    "quantized_segment_attention",
    "segment_table",
    "segments_of",
    "tabulate_prefill",
    "takes_segment_table",
]

Segments = list[tuple[int, int, bool]]


def segment_table(segments: Segments) -> torch.Tensor:
    """``segments`` as a flat (3 x runs,) int64 tensor on the host: start, end, is_text per run. Flat, so that a
    prompt-only prefix (one run) has a length of 3, not 1, which dynamo would specialise."""
    return torch.tensor([value for run in segments for value in run], dtype=torch.int64)


def segments_of(table: torch.Tensor) -> Segments:
    return [(start, end, bool(is_text)) for start, end, is_text in table.view(-1, 3).tolist()]


def takes_segment_table(processor: Any) -> bool:
    """Whether ``processor`` reads the prefix segments as a ``segment_table`` too."""
    return isinstance(processor, TabulatedPrefillProcessor)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


class _Projected:
    """An attention module's stand-in whose projections return ``query``, ``key`` and ``value`` (B, S, H, D) as
    they are, with identity norms and output, so that diffusers' processor runs only its attention calls."""

    norm_q = norm_k = staticmethod(_identity)
    to_out = (_identity, _identity)

    def __init__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        self.heads, head_dim = query.shape[2], query.shape[3]
        self.inner_dim = self.heads * head_dim
        self._qkv = (query.flatten(2, 3), key.flatten(2, 3), value.flatten(2, 3))

    def to_q(self, _hidden: torch.Tensor) -> torch.Tensor:
        return self._qkv[0]

    def to_k(self, _hidden: torch.Tensor) -> torch.Tensor:
        return self._qkv[1]

    def to_v(self, _hidden: torch.Tensor) -> torch.Tensor:
        return self._qkv[2]


def quantized_segment_attention(
    path: AttentionPath,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segments: list[tuple[int, int, bool]] | None,
    key_valid: torch.Tensor | None,
) -> torch.Tensor:
    """Qwen-Image-2.1's attention of (B, S, H, D) tensors through ``path``: block-causal over ``segments``
    (``(start, end, is_text)`` runs of the prefix), or full when None -> (B, S_q, H, D)."""
    qk = path.quantize(query, key, path.kind)
    sm_scale = query.shape[-1] ** -0.5
    if segments is None:
        return path.attend(qk, value, key_valid, None, sm_scale)
    outputs = [
        path.attend(
            qk.rows(start, end).keys(end), value[:, :end], key_valid, start if is_text else None, sm_scale
        )
        for start, end, is_text in segments
    ]
    prefix_len = segments[-1][1] if segments else 0
    outputs.append(path.attend(qk.rows(prefix_len, query.shape[1]), value, key_valid, None, sm_scale))
    return torch.cat(outputs, dim=1)


@torch.library.custom_op("ditq::prefill_attention", mutates_args=())
def prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    table: torch.Tensor,
    key_valid: torch.Tensor | None,
    path: str,
) -> torch.Tensor:
    """The prefill's attention of (B, S, H, D) tensors, block-causal over ``table``'s segments -> (B, S, H, D):
    diffusers' stock attention where ``path`` is empty, else the quantized-attention path of that name."""
    segments = segments_of(table)
    if path:
        return quantized_segment_attention(get_attention_kernel(path), query, key, value, segments, key_valid)
    projected = _Projected(query, key, value)
    hidden = QwenImage21AttnProcessor()(
        projected,  # type: ignore[arg-type]
        query.flatten(2, 3),
        segments=segments,
        key_valid=key_valid,
    )
    return hidden.unflatten(-1, (projected.heads, -1))


@prefill_attention.register_fake
def _prefill_attention_fake(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    table: torch.Tensor,
    key_valid: torch.Tensor | None,
    path: str,
) -> torch.Tensor:
    return query.new_empty(query.shape)


class TabulatedPrefillProcessor(QwenImage21AttnProcessor):
    """``QwenImage21AttnProcessor`` that also takes the prefix segments as a ``segment_table`` (from a compiled
    block), and then attends through ``prefill_attention``; with a list, or in decode, it is diffusers' own.
    ``attention_path`` names the quantized-attention path the op uses ("" for stock attention)."""

    attention_path = ""

    def __call__(
        self,
        attn: QwenImage21Attention,
        hidden_states: torch.Tensor,
        attention_mask: Any | None = None,
        rotary_emb: torch.Tensor | None = None,
        layer_cache: Any | None = None,
        kv_cache_mode: str | None = None,
        cache_write_slice: slice | None = None,
        segments: Segments | torch.Tensor | None = None,
        key_valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if not isinstance(segments, torch.Tensor):
            return self.attend(
                attn,
                hidden_states,
                attention_mask,
                rotary_emb,
                layer_cache,
                kv_cache_mode,
                cache_write_slice,
                segments,
                key_valid,
            )
        query, key, value, _ = _qwenimage21_prepare_qkv(
            attn, hidden_states, rotary_emb, layer_cache, kv_cache_mode, cache_write_slice
        )
        hidden = prefill_attention(query, key, value, segments, key_valid, self.attention_path)
        hidden = attn.to_out[0](hidden.flatten(2, 3).type_as(query))
        return attn.to_out[1](hidden)

    def attend(self, attn: QwenImage21Attention, hidden_states: torch.Tensor, *args: Any) -> torch.Tensor:
        """The processor's attention where no table was given: diffusers' own."""
        return super().__call__(attn, hidden_states, *args)


def tabulate_prefill(module: torch.nn.Module) -> None:
    """Give every attention module inside ``module`` that runs diffusers' stock processor a
    ``TabulatedPrefillProcessor`` (one, shared). Other processors are left as they are."""
    processor = TabulatedPrefillProcessor()
    for attention in [m for m in module.modules() if isinstance(m, QwenImage21Attention)]:
        if type(attention.processor) is QwenImage21AttnProcessor:
            attention.set_processor(processor)
