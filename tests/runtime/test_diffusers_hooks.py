"""The private diffusers internals the step cache and `--offload auto` read, one guarded function each: each works on the diffusers
installed (the version ``TESTED_DIFFUSERS`` names), and where a diffusers lacks the name it fails in one line naming
it and the tested version, never with an AttributeError or ImportError traceback."""

from __future__ import annotations

from importlib.metadata import version

import pytest
from tiny_models import tiny_adapter

from ditq.errors import DitqError
from ditq.runtime.diffusers_hooks import TESTED_DIFFUSERS, hook_states, register_cache_block
from ditq.runtime.step_cache import install_step_cache


def _one_line(error: BaseException, name: str) -> None:
    said = str(error)
    assert said.startswith(f"--cache: diffusers {version('diffusers')} has no {name}")
    assert f"tested against diffusers {TESTED_DIFFUSERS}" in said and "\n" not in said


def test_the_installed_diffusers_is_the_tested_one() -> None:
    """Another diffusers within the pin: run this file against it, then name it in ``TESTED_DIFFUSERS``."""
    assert version("diffusers") == TESTED_DIFFUSERS


def test_a_block_registers_and_the_block_caches_find_it() -> None:
    from diffusers.hooks._helpers import TransformerBlockRegistry
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21TransformerBlock

    register_cache_block(QwenImage21TransformerBlock, return_hidden_states_index=0)
    metadata = TransformerBlockRegistry.get(QwenImage21TransformerBlock)
    assert metadata.return_hidden_states_index == 0 and metadata.return_encoder_hidden_states_index is None


def test_a_diffusers_without_the_block_registry_is_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import diffusers.hooks._helpers
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21TransformerBlock

    monkeypatch.delattr(diffusers.hooks._helpers, "TransformerBlockRegistry")
    with pytest.raises(DitqError) as caught:
        register_cache_block(QwenImage21TransformerBlock, return_hidden_states_index=0)
    _one_line(caught.value, "diffusers.hooks._helpers.TransformerBlockRegistry")


def test_hook_states_are_the_cache_hooks_state_managers() -> None:
    from diffusers.hooks.hooks import StateManager

    adapter = tiny_adapter()
    run = install_step_cache(adapter.pipeline, "first-block:0.1")
    states = hook_states(adapter.pipeline.transformer)
    assert states and all(isinstance(state, StateManager) for state in states)
    assert states[0] is run._state


def test_a_diffusers_that_keeps_its_hooks_elsewhere_is_refused_in_one_line() -> None:
    """The registry attribute gone from every module, as in a diffusers that renamed it."""
    adapter = tiny_adapter()
    install_step_cache(adapter.pipeline, "first-block:0.1")
    for module in adapter.pipeline.transformer.modules():
        if hasattr(module, "_diffusers_hook"):
            del module._diffusers_hook
    with pytest.raises(DitqError) as caught:
        hook_states(adapter.pipeline.transformer)
    _one_line(caught.value, "hook registry at module._diffusers_hook")


def test_a_diffusers_without_state_manager_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import diffusers.hooks.hooks

    adapter = tiny_adapter()
    monkeypatch.delattr(diffusers.hooks.hooks, "StateManager")
    with pytest.raises(DitqError) as caught:
        hook_states(adapter.pipeline.transformer)
    _one_line(caught.value, "diffusers.hooks.hooks.StateManager")


def test_a_diffusers_without_the_group_offload_hook_names_is_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``remove_group_offloading`` (``--offload auto`` putting a streamed transformer back): the same one line."""
    import diffusers.hooks.group_offloading

    from ditq.runtime.diffusers_hooks import remove_group_offloading

    monkeypatch.delattr(diffusers.hooks.group_offloading, "_LAYER_EXECUTION_TRACKER")
    with pytest.raises(DitqError) as caught:
        remove_group_offloading(tiny_adapter().pipeline.transformer)
    said = str(caught.value)
    assert said.startswith(
        f"--offload auto: diffusers {version('diffusers')} has no group offloading hook names"
    )
    assert f"tested against diffusers {TESTED_DIFFUSERS}" in said and "\n" not in said
