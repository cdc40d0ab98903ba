"""The private diffusers internals the step cache and `--offload auto` read, one guarded function each: each works on the diffusers
installed (the version ``TESTED_DIFFUSERS`` names), and where a diffusers lacks the name it fails in one line naming
it and the tested version, never with an AttributeError or ImportError traceback."""

from __future__ import annotations

from importlib.metadata import version
from typing import Any

import pytest
import torch
from tiny_models import tiny_adapter

from ditq.errors import DitqError
from ditq.runtime.diffusers_hooks import (
    TESTED_DIFFUSERS,
    _offload_groups,
    hook_states,
    mend_offload_group,
    mend_stream_offload,
    register_cache_block,
)
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


class _Stream:
    """What a group's offload calls of its stream (the CUDA one has nothing else to do on the CPU)."""

    def synchronize(self) -> None:
        pass


def _quantized_block() -> torch.nn.Module:
    """A block whose weight is a buffer, as ditq's quantized Linears keep theirs, beside a parameter."""
    block = torch.nn.Linear(4, 4)
    block.register_buffer("weight_packed", torch.arange(8, dtype=torch.int32))
    return block


def _as_onloaded(block: torch.nn.Module, group: Any) -> None:
    """Every tensor of ``block`` pointed at a copy of its host tensor, as the group's onload leaves it (the copy
    stands for the device's)."""
    for tensor in (*block.parameters(), *block.buffers()):
        tensor.data = group.cpu_param_dict[tensor].clone()


def test_a_stream_offload_puts_the_blocks_buffers_back_on_their_host_copies_once_mended() -> None:
    """diffusers' own ModuleGroup offloading through a stream (huggingface/diffusers#13238): it puts parameters back
    on their host copies and leaves buffers on the device; once mended, buffers go back too, and a second mend does
    nothing."""
    from diffusers.hooks.group_offloading import ModuleGroup

    block = _quantized_block()
    cpu = torch.device("cpu")
    group = ModuleGroup(
        [block], cpu, cpu, offload_leader=block, stream=_Stream(), record_stream=True, low_cpu_mem_usage=True
    )
    host = group.cpu_param_dict[block.weight_packed]
    _as_onloaded(block, group)
    group.offload_()
    assert block.weight.data_ptr() == group.cpu_param_dict[block.weight].data_ptr()
    assert block.weight_packed.data_ptr() != host.data_ptr()  # the bug, as diffusers has it

    assert mend_offload_group(group) and not mend_offload_group(group)
    _as_onloaded(block, group)
    group.offload_()
    assert block.weight_packed.data_ptr() == host.data_ptr()
    assert block.weight.data_ptr() == group.cpu_param_dict[block.weight].data_ptr()

    no_stream = ModuleGroup([_quantized_block()], cpu, cpu, offload_leader=block)
    assert not mend_offload_group(no_stream)  # its offload moves whole modules, buffers too


def test_every_stream_offloaded_group_under_a_module_is_found_and_mended() -> None:
    """The groups diffusers' block-level offload hooks under a model (the denoiser's blocks and the rest); on the
    CPU they carry no stream, so each is given one here as CUDA's would be."""
    from diffusers.hooks import apply_group_offloading

    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([_quantized_block() for _ in range(3)])
    model.head = torch.nn.Linear(4, 2)
    apply_group_offloading(
        model, onload_device=torch.device("cpu"), offload_type="block_level", num_blocks_per_group=1
    )
    groups = _offload_groups(model)
    assert len(groups) >= 3 and mend_stream_offload(model) == 0  # no stream: nothing to mend
    for group in groups:
        group.stream, group.record_stream, group.low_cpu_mem_usage = _Stream(), True, True
        group.cpu_param_dict = group._init_cpu_param_dict()
    assert mend_stream_offload(model) == len(groups) and mend_stream_offload(model) == 0
    first = next(g for g in groups if model.blocks[0] in g.modules)
    _as_onloaded(model.blocks[0], first)
    first.offload_()
    assert (
        model.blocks[0].weight_packed.data_ptr()
        == first.cpu_param_dict[model.blocks[0].weight_packed].data_ptr()
    )
