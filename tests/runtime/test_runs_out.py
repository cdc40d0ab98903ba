"""``runs_out``: a call that ran out of memory lets go of what its frames held before the placement moves; a call
that ran pays for no garbage collection (one took 0.33 s in a process of many objects, every calibration shape)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
import torch

import ditq.runtime.memory as memory
from ditq.runtime.offload import runs_out


@pytest.fixture
def asked(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """What runs_out asked for, in order: full collections and emptied accelerator caches; the collector's own
    runs are off, so a cycle is freed only by the collection runs_out asks for."""
    asked: list[str] = []
    collect, empty = gc.collect, memory.empty_accelerator_cache

    def counted_collect(*args: int) -> int:
        asked.append("collect")
        return collect(*args)

    def counted_empty() -> None:
        asked.append("empty")
        empty()

    monkeypatch.setattr(gc, "collect", counted_collect)
    monkeypatch.setattr(memory, "empty_accelerator_cache", counted_empty)
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield asked
    finally:
        if enabled:
            gc.enable()


def _held_in_a_cycle() -> tuple[dict[str, object], weakref.ref[torch.Tensor]]:
    """A tensor that only a reference cycle keeps: freed by a full collection, not by reference counts."""
    activations = torch.zeros(256, 256)
    frame: dict[str, object] = {"activations": activations}
    frame["self"] = frame
    return frame, weakref.ref(activations)


def test_a_call_that_ran_out_of_memory_lets_go_of_what_its_frames_held(asked: list[str]) -> None:
    refs: list[weakref.ref[torch.Tensor]] = []

    def call() -> None:
        frame, ref = _held_in_a_cycle()
        refs.append(ref)
        error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        error.ditq_stage = "denoising"  # type: ignore[attr-defined]
        # the traceback's frames and the cycle hold each other, as a failed forward's do
        frame["error"] = error
        raise error

    assert runs_out(call) == (True, "denoising")
    assert asked == ["collect", "empty"]
    assert refs[0]() is None


def test_any_other_error_is_raised_and_the_memory_freed_after_it_all_the_same(asked: list[str]) -> None:
    def call() -> None:
        raise ValueError("not a memory error")

    with pytest.raises(ValueError, match="not a memory error"):
        runs_out(call)
    assert asked == ["collect", "empty"]


def test_a_call_that_ran_pays_for_no_garbage_collection(asked: list[str]) -> None:
    ran: list[bool] = []
    assert runs_out(lambda: ran.append(True)) == (False, None)
    assert ran == [True]
    assert asked == ["empty"]
