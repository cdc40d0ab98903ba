"""What ditq's step cache (``--cache``) reads of diffusers' hooks that diffusers does not make public: one function
per private access, each failing in one line that names it and the version it was tested against.

diffusers 0.42 gives the caches a public face (``CacheMixin.enable_cache``, ``disable_cache``, ``cache_context``;
``diffusers.hooks.HookRegistry.reset_stateful_hooks``; ``StateManager.context``), which ``ditq.runtime.step_cache``
calls directly. Two things it needs have no public form:

- **registering a block class** with the block-level caches (First Block Cache, MagCache): they look a block's
  outputs up in ``TransformerBlockRegistry``, in the private module ``diffusers.hooks._helpers``, which diffusers
  fills for its own models only, and for Qwen-Image-2.1 not at all (``register_cache_block``);
- **a hook's state** after a call (whether it computed): the hooks live in ``module._diffusers_hook``, the private
  attribute ``HookRegistry.check_if_exists_or_initialize`` sets, and their ``StateManager``s in the hooks' own
  attributes (``hook_states``; asking every module for its registry through the public call would add one to each).

Tested against diffusers 0.42.1, within pyproject's pin (``diffusers>=0.42,<0.43``).
"""

from __future__ import annotations

from importlib.metadata import version
from typing import Any

import torch

from ditq.errors import DitqError

__all__ = ["TESTED_DIFFUSERS", "hook_states", "register_cache_block"]

TESTED_DIFFUSERS = "0.42.1"  # the diffusers every access here is tested against


def _moved(name: str) -> DitqError:
    """The one line for a private name this diffusers does not have."""
    return DitqError(
        f"--cache: diffusers {version('diffusers')} has no {name}, which ditq's step cache reads (tested against "
        f"diffusers {TESTED_DIFFUSERS}); install diffusers>=0.42,<0.43"
    )


def register_cache_block(block_class: type[torch.nn.Module], return_hidden_states_index: int) -> None:
    """``block_class`` in diffusers' block registry (``diffusers.hooks._helpers.TransformerBlockRegistry``): the
    block-level caches find its output ``hidden_states`` at ``return_hidden_states_index`` and no separate
    ``encoder_hidden_states`` stream. A later call writes the same entry."""
    try:
        from diffusers.hooks._helpers import TransformerBlockMetadata, TransformerBlockRegistry
    except ImportError:
        raise _moved("diffusers.hooks._helpers.TransformerBlockRegistry") from None
    TransformerBlockRegistry.register(
        model_class=block_class,
        metadata=TransformerBlockMetadata(return_hidden_states_index=return_hidden_states_index),
    )


def hook_states(transformer: torch.nn.Module) -> list[Any]:
    """The ``StateManager`` of every stateful hook under ``transformer`` (``module._diffusers_hook``'s hooks), in
    module order; at least one, or the one line: call it after ``enable_cache``."""
    try:
        from diffusers.hooks.hooks import StateManager
    except ImportError:
        raise _moved("diffusers.hooks.hooks.StateManager") from None
    states = [
        attr
        for module in transformer.modules()
        if (registry := getattr(module, "_diffusers_hook", None)) is not None
        for hook in registry.hooks.values()
        for attr in vars(hook).values()
        if isinstance(attr, StateManager)
    ]
    if not states:
        raise _moved("hook registry at module._diffusers_hook holding the cache's stateful hooks")
    return states
