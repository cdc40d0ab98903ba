"""Qwen-Image-2.1 (diffusers' ``QwenImage21Transformer2DModel``): what ditq adds to its transformer, behind the
interface every model family offers (``ditq.runtime.models.ModelFamily``).

- ``attention``: the quantized-attention processor (``--attention``);
- ``prefill``: the block-causal prefill as one custom op, so that a compiled block serves every reference count;
- ``fuse``: query/key/value and gate/up projections as one GEMM each (``fuse=True``);
- ``kv_cache``: the prefix KV cache in 8 bits (``--kv-cache``);
- ``context_parallel``: the plan and processor of ``--parallel cp=N`` (diffusers declares none for this model);
- ``step_cache``: its block in diffusers' block registry, which diffusers' step caches read (``--cache``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from ditq.kernels.attention import AttentionPath
from ditq.runtime.models.qwenimage21 import attention, context_parallel, fuse, kv_cache, prefill, step_cache

__all__ = ["QWENIMAGE21", "QwenImage21"]


class QwenImage21:
    """The Qwen-Image-2.1 family: its transformer and repeated block by class name, and what ditq does to them."""

    name = "Qwen-Image-2.1"
    transformer_class = "QwenImage21Transformer2DModel"
    block_classes: tuple[str, ...] = ("QwenImage21TransformerBlock",)
    context_parallel_plan = True  # ``--parallel cp=N`` can split it

    def attention_shape(self, transformer: torch.nn.Module) -> tuple[int, int]:
        """(heads, head dim) of the transformer's attention."""
        first = attention.attention_modules(transformer)[0]
        return first.heads, first.inner_dim // first.heads

    def install_attention(self, transformer: torch.nn.Module, path: AttentionPath) -> None:
        attention.install_attention(transformer, path)

    def install_kv_cache(self, transformer: torch.nn.Module, kind: str) -> RemovableHandle | None:
        return kv_cache.install_kv_cache(transformer, kind)

    def fuse_projections(self, module: torch.nn.Module) -> int:
        return fuse.fuse_projections(module)

    def prepare_compiled_block(self, block: torch.nn.Module) -> None:
        prefill.tabulate_prefill(block)

    def compiled_block_arguments(self, block: torch.nn.Module, kwargs: dict[str, Any]) -> None:
        """The prefix segments as a table where the block's processor takes one (``prefill``): dynamo would unroll
        the list's loop and guard on its length, a prefix graph per reference count."""
        segments = kwargs.get("segments")
        if isinstance(segments, list) and prefill.takes_segment_table(
            getattr(getattr(block, "attn", None), "processor", None)
        ):
            kwargs["segments"] = prefill.segment_table(segments)

    def enable_context_parallel(self, transformer: torch.nn.Module, degree: int) -> None:
        context_parallel.enable_context_parallel(transformer, degree)

    def register_cache_blocks(self) -> None:
        step_cache.register_cache_blocks()


QWENIMAGE21 = QwenImage21()
