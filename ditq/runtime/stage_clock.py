"""Per-stage wall-clock timings and peak memory of one pipeline call, taken by wrapping the pipeline's own stages.

For the length of one call, ``StageClock.instrument`` shadows ``encode_prompt`` (or hooks the text encoders'
forwards), ``vae.decode`` and ``vae.encode`` with timed wrappers and hooks the transformer's forwards; the
adapter marks the end of every denoising step from ``callback_on_step_end``. On CUDA each mark synchronizes,
so the times are wall time of finished work. Everything is put back when the block ends.

On CUDA each stage is also a memory segment: the allocator's peak is read and reset where a stage starts and
where it ends, so ``stage_peaks`` holds the peak allocated bytes of each stage (``text_encoding``,
``image_encoding``, ``first_step`` -- the first transformer forward, which fills a prefix KV cache where the
pipeline keeps one --, ``later_steps``, ``decoding``) and of the work between them (``other``), and their
maximum is the call's peak.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

__all__ = ["StageClock", "shadowed"]

_TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")


class StageClock:
    """Wall-clock marks (and on CUDA peak memory) for one pipeline call; synchronizes CUDA first so marks follow
    finished work."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.totals: dict[str, float] = {}
        self.first_start: dict[str, float] = {}
        self.last_end: dict[str, float] = {}
        self.step_marks: list[float] = []
        self.stage_peaks: dict[str, int] = {}  # CUDA: peak allocated bytes per stage (module docstring)
        self.start_allocated: int | None = None  # CUDA: allocated bytes when the call began
        # the stages begun and not yet ended, innermost last: stages inside stages count for the outer one
        self._open: list[str] = []
        self._raised_in: str | None = None  # the innermost stage an exception left

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _close_segment(self, stage: str) -> None:
        """The allocator's peak since the last reset belongs to ``stage``; the next segment starts from here."""
        if not self.cuda:
            return
        peak = int(torch.cuda.max_memory_allocated(self.device))
        self.stage_peaks[stage] = max(self.stage_peaks.get(stage, 0), peak)
        torch.cuda.reset_peak_memory_stats(self.device)

    def begin(self) -> float:
        """The call's start: memory is measured from here."""
        start = self.now()
        if self.cuda:
            self.start_allocated = int(torch.cuda.memory_allocated(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)
        return start

    def end(self) -> float:
        end = self.now()
        self._close_segment("other")
        return end

    def peak_bytes(self) -> int | None:
        """The call's peak allocated bytes (CUDA), else None."""
        return max(self.stage_peaks.values()) if self.cuda and self.stage_peaks else None

    def enter(self, stage: str) -> float:
        """A stage starts: the memory since the last stage was the work between stages (``other``)."""
        start = self.now()
        if not self._open:
            self._close_segment("other")
        self._open.append(stage)
        return start

    def leave(self, stage: str, start: float, segment: str | None = None) -> None:
        """A stage ends: its time goes to ``stage``, its peak memory to ``segment`` (default: ``stage``)."""
        end = self.now()
        self._open.pop()
        if not self._open:
            self._close_segment(segment or stage)
        self.add(stage, start, end)

    def add(self, stage: str, start: float, end: float) -> None:
        self.totals[stage] = self.totals.get(stage, 0.0) + (end - start)
        self.first_start.setdefault(stage, start)
        self.last_end[stage] = end

    def timed(self, stage: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = self.enter(stage)
            try:
                return function(*args, **kwargs)
            except BaseException:
                self._raised_in = self._raised_in or self._open[-1]
                raise
            finally:
                self.leave(stage, start)

        return wrapper

    def failed_stage(self) -> str | None:
        """After a call raised: the stage it raised in (``text_encoding``, ``image_encoding``,
        ``denoising_forward``, ``decoding``), or None where it raised between stages."""
        return self._raised_in or (self._open[-1] if self._open else None)

    def mark_step(self) -> int:
        """The end of one denoising step (from ``callback_on_step_end``); returns the steps marked so far."""
        self.step_marks.append(self.now())
        return len(self.step_marks)

    @contextmanager
    def instrument(self, pipeline: Any) -> Iterator[None]:
        """Time ``pipeline``'s stages for the length of the block: ``encode_prompt`` (or the text encoders'
        forwards), ``vae.decode`` and ``vae.encode``, and the transformer's forwards."""
        with ExitStack() as stack:
            if callable(getattr(pipeline, "encode_prompt", None)):
                stack.enter_context(
                    shadowed(pipeline, "encode_prompt", self.timed("text_encoding", pipeline.encode_prompt))
                )
            else:
                for name in _TEXT_ENCODERS:
                    encoder = getattr(pipeline, name, None)
                    if isinstance(encoder, torch.nn.Module):
                        stack.enter_context(_forward_timer(encoder, "text_encoding", self))
            vae = getattr(pipeline, "vae", None)
            if vae is not None and callable(getattr(vae, "decode", None)):
                stack.enter_context(shadowed(vae, "decode", self.timed("decoding", vae.decode)))
            if vae is not None and callable(getattr(vae, "encode", None)):
                stack.enter_context(shadowed(vae, "encode", self.timed("image_encoding", vae.encode)))
            transformer = getattr(pipeline, "transformer", None)
            if isinstance(transformer, torch.nn.Module):
                stack.enter_context(_forward_timer(transformer, "denoising_forward", self))
            yield

    def step_times(self) -> list[float]:
        """Seconds per denoising step: the first from the transformer's first forward."""
        if not self.step_marks:
            return []
        first = self.first_start.get("denoising_forward", self.step_marks[0])
        marks = [first, *self.step_marks]
        return [b - a for a, b in itertools.pairwise(marks)]

    def timings(self, start: float, end: float) -> dict[str, float]:
        """Seconds per stage of a call from ``start`` to ``end``: text_encoding, denoising, decoding,
        image_encoding (where the pipeline encoded images), postprocess (after the last stage), total."""
        timings = {"text_encoding": self.totals.get("text_encoding", 0.0)}
        if "denoising_forward" in self.first_start:
            denoise_end = max(
                self.step_marks[-1] if self.step_marks else 0.0, self.last_end["denoising_forward"]
            )
            timings["denoising"] = denoise_end - self.first_start["denoising_forward"]
        else:
            timings["denoising"] = 0.0
        timings["decoding"] = self.totals.get("decoding", 0.0)
        if "image_encoding" in self.totals:
            timings["image_encoding"] = self.totals["image_encoding"]
        last_stage_end = max([start, *self.last_end.values(), *self.step_marks])
        timings["postprocess"] = end - last_stage_end
        timings["total"] = end - start
        return timings


@contextmanager
def shadowed(target: Any, name: str, replacement: Callable[..., Any]) -> Iterator[None]:
    """Shadow ``target.name`` with an instance attribute for the duration of the block."""
    had_own = name in vars(target)
    original = vars(target).get(name)
    setattr(target, name, replacement)
    try:
        yield
    finally:
        if had_own:
            setattr(target, name, original)
        else:
            delattr(target, name)


@contextmanager
def _forward_timer(module: torch.nn.Module, stage: str, clock: StageClock) -> Iterator[None]:
    """Time ``module``'s forwards as ``stage``; the transformer's (``denoising_forward``) are also memory segments,
    its first forward ``first_step`` and the rest ``later_steps``."""
    starts: list[float] = []
    forwards = [0]

    def pre_hook(_module: torch.nn.Module, _args: Any) -> None:
        starts.append(clock.enter(stage))  # a forward that raises never reaches the post-hook: it stays open

    def post_hook(_module: torch.nn.Module, _args: Any, _output: Any) -> None:
        segment = None
        if stage == "denoising_forward":
            segment = "first_step" if forwards[0] == 0 else "later_steps"
        forwards[0] += 1
        clock.leave(stage, starts.pop(), segment)

    handles = [module.register_forward_pre_hook(pre_hook), module.register_forward_hook(post_hook)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
