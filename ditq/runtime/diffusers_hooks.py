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

``--offload auto`` needs three more (the third, ``mend_stream_offload``, mends a bug of diffusers' own, below):
taking diffusers' group offload off a transformer that streamed during calibration when streaming it bought nothing
(``remove_group_offloading``: the hooks' registered names, private constants); and mending what its streams do to a
block cache (``prefetch_pending``, ``reconnect_cut_hooks``): with
``use_stream=True`` diffusers registers a layer-execution tracker on every block, and removes them after the
transformer's first call; ``HookRegistry.remove_hook`` then points the hook registered after each (the block cache's)
at what the tracker wrapped, through its ``fn_ref.forward``, which for a hook that replaces ``forward``
(``new_forward``: First Block Cache's) is that replacement: the block would compute at every step from the second call
on. Measured on an H100: a First Block Cache that skipped every call it could resident skipped none streamed.

Tested against diffusers 0.42.1, within pyproject's pin (``diffusers>=0.42,<0.43``).
"""

from __future__ import annotations

import functools
from importlib.metadata import version
from typing import Any

import torch

from ditq.errors import DitqError

__all__ = [
    "TESTED_DIFFUSERS",
    "hook_states",
    "mend_stream_offload",
    "prefetch_pending",
    "reconnect_cut_hooks",
    "register_cache_block",
    "remove_group_offloading",
]

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


def remove_group_offloading(module: torch.nn.Module) -> None:
    """diffusers' group offload (``apply_group_offloading``) taken off ``module`` and its submodules: its hooks, by
    the names ``diffusers.hooks.group_offloading`` registers them under (diffusers has no public call that removes
    it); the weights stay where the hooks left them (the caller moves the module)."""
    try:
        from diffusers.hooks import HookRegistry
        from diffusers.hooks.group_offloading import (
            _GROUP_OFFLOADING,
            _LAYER_EXECUTION_TRACKER,
            _LAZY_PREFETCH_GROUP_OFFLOADING,
        )
    except ImportError:
        raise DitqError(
            f"--offload auto: diffusers {version('diffusers')} has no group offloading hook names in "
            f"diffusers.hooks.group_offloading, which ditq reads to make a streamed transformer resident again "
            f"(tested against diffusers {TESTED_DIFFUSERS}); install diffusers>=0.42,<0.43"
        ) from None
    registry = HookRegistry.check_if_exists_or_initialize(module)
    for name in (_LAZY_PREFETCH_GROUP_OFFLOADING, _LAYER_EXECUTION_TRACKER, _GROUP_OFFLOADING):
        registry.remove_hook(name, recurse=True)


def prefetch_pending(module: torch.nn.Module) -> bool:
    """Whether ``module`` carries diffusers' lazy prefetch hook (group offload with streams, before its first call
    has recorded the blocks' order and removed its trackers)."""
    try:
        from diffusers.hooks.group_offloading import _LAZY_PREFETCH_GROUP_OFFLOADING
    except ImportError:
        raise _moved("diffusers.hooks.group_offloading._LAZY_PREFETCH_GROUP_OFFLOADING") from None
    registry = getattr(module, "_diffusers_hook", None)
    return registry is not None and registry.get_hook(_LAZY_PREFETCH_GROUP_OFFLOADING) is not None


def reconnect_cut_hooks(module: torch.nn.Module) -> int:
    """Every hook under ``module`` that replaces ``forward`` (``new_forward``) and was cut out of its chain by the
    removal of a hook registered before it (see above) put back: its ``fn_ref.forward`` its ``new_forward`` again,
    and what it wraps (``original_forward``) what the removal left it pointing at. Its state is kept. How many."""
    mended = 0
    for submodule in module.modules():
        registry = getattr(submodule, "_diffusers_hook", None)
        if registry is None:
            continue
        for hook in registry.hooks.values():
            replacement = getattr(hook, "new_forward", None)
            fn_ref = getattr(hook, "fn_ref", None)
            if replacement is None or fn_ref is None:
                continue
            current = fn_ref.forward
            if isinstance(current, functools.partial) and current.func == replacement:
                continue
            fn_ref.original_forward = current
            fn_ref.forward = functools.update_wrapper(
                functools.partial(replacement, registry._module_ref), replacement
            )
            mended += 1
    return mended


def _offload_groups(module: torch.nn.Module) -> list[Any]:
    """The distinct ``ModuleGroup``s of diffusers' group offload hooks under ``module``, in module order."""
    try:
        from diffusers.hooks.group_offloading import _GROUP_OFFLOADING
    except ImportError:
        raise _moved("diffusers.hooks.group_offloading._GROUP_OFFLOADING") from None
    groups: dict[int, Any] = {}
    for submodule in module.modules():
        registry = getattr(submodule, "_diffusers_hook", None)
        hook = registry.get_hook(_GROUP_OFFLOADING) if registry is not None else None
        if hook is not None:
            groups.setdefault(id(hook.group), hook.group)
    return list(groups.values())


def mend_offload_group(group: Any) -> bool:
    """One ``ModuleGroup`` that offloads through a stream mended: after its own offload, every buffer of its modules
    that has a host copy (``cpu_param_dict``) points at that copy again, as every parameter already does. diffusers
    0.42's ``ModuleGroup._offload_to_memory`` leaves the modules' buffers on the device when it offloads through a
    stream (huggingface/diffusers#13238); ditq's quantized Linears keep their weights in buffers, so a streamed
    quantized transformer stayed whole on the device after its first call: on an H100 under 16 GiB a w4a8 request
    measured 3.45 GiB more with the transformer streamed than resident, about its blocks' size, and the streamed
    placement left 4.65 GiB allocated between requests (``benchmarks/results/h100-four-bit/``, run 6). Whether it
    was mended now (a group without a stream, or mended before, is left as it is)."""
    if group.stream is None or getattr(group, "ditq_buffers_mended", False):
        return False
    offload = group._offload_to_memory

    def offload_with_buffers() -> None:
        offload()
        for module in group.modules:
            for buffer in module.buffers():
                host = group.cpu_param_dict.get(buffer)
                if host is not None:
                    buffer.data = host

    group._offload_to_memory = offload_with_buffers
    group.ditq_buffers_mended = True
    return True


def mend_stream_offload(module: torch.nn.Module) -> int:
    """Every stream-offloaded group under ``module`` mended (``mend_offload_group``); how many."""
    return sum(mend_offload_group(group) for group in _offload_groups(module))
