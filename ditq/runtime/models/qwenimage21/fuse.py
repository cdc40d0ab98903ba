"""Fused projections: quantized Linears that read the same input become one GEMM at load.

In every Qwen-Image-2.1 block the attention's query, key and value projections read one input, and so do the
feed-forward's gate and up projections. Run apart, each quantizes that input again (per token, for W8A8 and FP8)
and launches its own, narrower GEMM. Fused, the input is quantized once and one GEMM of the summed width runs.

The fusion is exact per output channel: every stored weight row keeps its own scale, so the fused Linear's rows
are the members' rows, stacked, and its output columns are theirs (``ditq.runtime.modules.fuse_linears``: stored tensors read,
concatenated and written back through the layers' own codec). The checkpoint is untouched: the artifact keeps the
separate projections compressed-tensors and diffusers name; only the loaded module fuses them, before the repack.

Measured, it does not pay yet: on an H200 (full-size Qwen-Image-2.1 DiT, 1024², eager) the fused fp8 denoising
loop took 1.052x (0 references) and 1.054x (4 references) the time of the separate layers
(``benchmarks/results/dit_bench_fused_eager_h200_7d332ce.json``), so ``ditq.load_pipeline`` fuses only when asked
(``fuse=True``). Where the time goes was not profiled; one suspect is that the slices of the fused output are
strided views, which the norms, RoPE and attention after them read as such, and another the wider GEMM's tiling.

The modules keep diffusers' own forward code:

- ``QwenImage21Attention``: ``to_qkv`` replaces ``to_q``, ``to_k``, ``to_v``; the processor
  (``FusedQKVAttnProcessor``, or ditq's quantized-attention processor) computes the one projection and hands
  diffusers' ``_qwenimage21_prepare_qkv`` a view whose ``to_q``/``to_k``/``to_v`` return the three slices, so
  norms, RoPE and the KV-cache bookkeeping stay diffusers' own;
- ``QwenImage21SwiGLUFeedForward``: ``FusedSwiGLUFeedForward`` holds ``gate_proj`` (gate and up, stacked)
  and the same ``out``.

Only groups whose members are quantized alike (one scheme, group size, input width and bias presence), unprepared
and in the stored form are fused; anything else is left as it was.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models.transformers.transformer_qwenimage21 import (
    QwenImage21Attention,
    QwenImage21AttnProcessor,
    QwenImage21SwiGLUFeedForward,
)

from ditq.runtime.memory import return_free_host_memory
from ditq.runtime.models.qwenimage21.prefill import TabulatedPrefillProcessor
from ditq.runtime.modules import QuantizedLinear, fusable, fuse_linears

__all__ = [
    "FusedQKVAttnProcessor",
    "FusedSwiGLUFeedForward",
    "fuse_projections",
    "fused_attention_view",
]


class _ProjectedAttention:
    """What ``_qwenimage21_prepare_qkv`` reads of an attention module, with the three projections already done."""

    def __init__(self, attn: QwenImage21Attention, hidden_states: torch.Tensor) -> None:
        self._q, self._k, self._v = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        self.heads = attn.heads
        self.inner_dim = attn.inner_dim
        self.norm_q = attn.norm_q
        self.norm_k = attn.norm_k
        self.to_out = attn.to_out

    def to_q(self, _hidden_states: torch.Tensor) -> torch.Tensor:
        return self._q

    def to_k(self, _hidden_states: torch.Tensor) -> torch.Tensor:
        return self._k

    def to_v(self, _hidden_states: torch.Tensor) -> torch.Tensor:
        return self._v


def fused_attention_view(attn: Any, hidden_states: torch.Tensor) -> Any:
    """``attn`` itself, or where its projections are fused, a view that has them computed for ``hidden_states``."""
    if getattr(attn, "to_qkv", None) is None:
        return attn
    return _ProjectedAttention(attn, hidden_states)


class FusedQKVAttnProcessor(TabulatedPrefillProcessor):
    """diffusers' ``QwenImage21AttnProcessor`` over one fused query/key/value projection (a compiled block's
    prefill through ``ditq.runtime.models.qwenimage21.prefill.prefill_attention``)."""

    def __call__(
        self, attn: QwenImage21Attention, hidden_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        return super().__call__(fused_attention_view(attn, hidden_states), hidden_states, *args, **kwargs)


class FusedSwiGLUFeedForward(torch.nn.Module):
    """``QwenImage21SwiGLUFeedForward`` with its gate and up projections as one GEMM (``gate_proj``)."""

    def __init__(
        self, gate_proj: QuantizedLinear, out: torch.nn.Module, activation_fn: torch.nn.Module
    ) -> None:
        super().__init__()
        self.gate_proj = gate_proj
        self.out = out
        self.activation_fn = activation_fn

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(hidden_states).chunk(2, dim=-1)
        return self.out(self.activation_fn(gate) * up)


def _fuse_attention(attn: QwenImage21Attention) -> bool:
    members = {name: getattr(attn, name) for name in ("to_q", "to_k", "to_v")}
    if not fusable(list(members.values())) or type(attn.processor) is not QwenImage21AttnProcessor:
        return False
    attn.to_qkv = fuse_linears(members)
    for name in members:
        delattr(attn, name)
    attn.set_processor(FusedQKVAttnProcessor())
    return True


def _fuse_feed_forward(parent: torch.nn.Module, name: str, ff: QwenImage21SwiGLUFeedForward) -> bool:
    members = {"gate_layer": ff.gate_layer, "proj": ff.proj}
    if not fusable(list(members.values())):
        return False
    fused = FusedSwiGLUFeedForward(fuse_linears(members), ff.out, ff.activation_fn)  # type: ignore[arg-type]
    setattr(parent, name, fused)
    return True


def _on_host(module: torch.nn.Module) -> bool:
    return any(t.device.type == "cpu" for t in module.buffers())


def fuse_projections(module: torch.nn.Module) -> int:
    """Fuse every fusable projection group inside ``module`` (before its quantized layers are repacked);
    returns how many fused Linears were made."""
    kinds = (QwenImage21Attention, QwenImage21SwiGLUFeedForward)
    # (parent, name) pairs only: holding the children would keep every replaced Linear alive until the end
    places = [(p, n) for p in module.modules() for n, c in p.named_children() if isinstance(c, kinds)]
    fused = 0
    for parent, name in places:
        child = getattr(parent, name)
        if isinstance(child, QwenImage21Attention):
            done = _fuse_attention(child)
        else:
            done = _fuse_feed_forward(parent, name, child)
        fused += done
        if done and _on_host(parent):
            # the fused copy was allocated while the replaced Linears still existed: without handing their pages
            # back, the host heap keeps their holes and a model grows by the fused layers' size while it loads
            return_free_host_memory()
    return fused
