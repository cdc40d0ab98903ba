"""diffusers' step caches on Qwen-Image-2.1 (``--cache``): its block made known to diffusers' block registry.

diffusers' block-level caches (First Block Cache, MagCache) read a block's inputs and outputs through
``TransformerBlockRegistry``, which diffusers 0.42 fills for its other models but not for
``QwenImage21TransformerBlock``, and offers no public call to extend (``ditq.runtime.diffusers_hooks``). The block
takes ``hidden_states`` (the joint text, reference and target sequence) and returns that one tensor, as Wan's block
does; there is no separate ``encoder_hidden_states`` stream.
"""

from __future__ import annotations

from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21TransformerBlock

from ditq.runtime.diffusers_hooks import register_cache_block

__all__ = ["register_cache_blocks"]


def register_cache_blocks() -> None:
    """``QwenImage21TransformerBlock`` in diffusers' block registry (a later call writes the same entry)."""
    register_cache_block(
        QwenImage21TransformerBlock, return_hidden_states_index=0
    )  # no encoder_hidden_states stream
