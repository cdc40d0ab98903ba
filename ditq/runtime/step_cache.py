"""diffusers' training-free step caches behind one option, ``--cache KIND:VALUE``: a denoising step whose input
has changed little since the last one is served (wholly or in part) from what that step computed.

diffusers 0.42 ships them as hooks (``transformer.enable_cache(config)``); ditq re-implements none of them. It adds
three things the hooks need and ditq's pipelines do not give them:

- **A cache context around every transformer call.** The hooks keep their state per context
  (``transformer.cache_context(name)``); ``DitqDemoPipeline`` opens one per kind of call ("extract", "denoise"), and
  diffusers' Qwen-Image-2.1 pipeline one per guidance branch ("cond", "uncond") for the whole request. Under the
  prefix KV cache the first call (``extract``) runs the whole joint sequence and the later ones (``cached``) the
  target tokens only, so one context would compare a step with a step of another shape. Each call therefore runs in
  a context of its own kind: ``prefix`` for the extract call, ``denoise`` for the others (inside the pipeline's own
  context, where it opens one). A context's first
  call is always computed by every kind offered here (First Block Cache has no residual to compare with;
  TaylorSeer's warm-up is at least one call), so the extract call, the only one of its context, is never skipped
  and the KV cache is always filled.
- **A fresh state per request.** The hooks are reset where a request begins (``StepCacheRun.begin``), not only at
  its end: a cancelled request never reaches the pipeline's own reset, and its residuals must not skip the next
  request's steps.
- **A count of what was skipped.** After every call the hook's state says whether it computed: ``skipped_steps``
  is how many of a request's transformer calls were served from the cache.

Offered: ``first-block:THRESHOLD`` (First Block Cache: the first block always runs; when its residual moved by less
than THRESHOLD, relative mean absolute difference, since the last computed call, the other blocks are skipped and
their last residual reused; 0 never skips) and ``taylorseer:INTERVAL[:WARMUP]`` (TaylorSeer: the attention outputs
are computed on the first WARMUP calls (default 3) and then every INTERVAL-th, and predicted by a first-order Taylor
series in between; 1 never predicts). MagCache is refused: it needs magnitude ratios calibrated per model and step
count. Refused beside ``--compile`` (the hooks decide per call, in Python, around each block) and ``--parallel``
(each rank would decide alone). The model family says which blocks the hooks wrap (``register_cache_blocks``).
diffusers' public calls drive the hooks; the two things read from its private internals (the block registry, a
hook's state) are ``ditq.runtime.diffusers_hooks``'s, one guarded function each.
Every ``--offload`` mode composes with the hooks: they are registered after the offload hooks, so they run first and
a block they skip is not copied (``StepCacheRun.wrap_outermost`` registers them again where the transformer begins
to stream later, ``Placement.demote``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from ditq.errors import InputError
from ditq.runtime.diffusers_hooks import hook_states, prefetch_pending, reconnect_cut_hooks

__all__ = [
    "AUTO",
    "CACHE_FLAG",
    "STEP_CACHE_KINDS",
    "StepCacheRun",
    "StepCacheSpec",
    "install_step_cache",
    "parse_step_cache",
]

CACHE_FLAG = "--cache"
AUTO = "auto"  # ``ditq sweep --cache auto``: the sweep searches a setting (``ditq.sweep.step_cache``)
_SYNTAX = "first-block:THRESHOLD or taylorseer:INTERVAL[:WARMUP]"


@dataclass(frozen=True)
class StepCacheSpec:
    """One setting: ``kind`` (a key of ``STEP_CACHE_KINDS``) and its numbers, in the order its syntax names them."""

    kind: str
    values: tuple[float, ...]

    def __str__(self) -> str:
        return ":".join([self.kind, *(f"{value:g}" for value in self.values)])


@dataclass(frozen=True)
class _Kind:
    """One step cache of diffusers: how its words read, the config they make, and whether a call skipped."""

    syntax: str
    parse: Callable[
        [list[str]], tuple[float, ...]
    ]  # the words after KIND: -> values; ValueError when unreadable
    config: Callable[
        [tuple[float, ...], torch.dtype], Any
    ]  # values, the transformer's dtype -> diffusers' config
    skipped: Callable[
        [Any], bool
    ]  # a hook's state after a call -> whether that call was served from the cache


STEP_CACHE_KINDS: dict[str, _Kind] = {}


class _Refused(ValueError):
    """A setting that reads but cannot be served; its message says why."""


def register_step_cache(name: str, syntax: str) -> Callable[[Any], Any]:
    """Class decorator: a step cache named ``name`` (its ``parse``, ``config`` and ``skipped`` static methods)."""

    def register(cls: Any) -> Any:
        STEP_CACHE_KINDS[name] = _Kind(syntax, cls.parse, cls.config, cls.skipped)
        return cls

    return register


@register_step_cache("first-block", "first-block:THRESHOLD (a number >= 0, e.g. 0.1)")
class _FirstBlock:
    @staticmethod
    def parse(words: list[str]) -> tuple[float, ...]:
        (threshold,) = words
        value = float(threshold)
        if not (math.isfinite(value) and value >= 0):
            raise ValueError
        return (value,)

    @staticmethod
    def config(values: tuple[float, ...], dtype: torch.dtype) -> Any:
        from diffusers import FirstBlockCacheConfig

        return FirstBlockCacheConfig(threshold=values[0])

    @staticmethod
    def skipped(state: Any) -> bool:
        return not state.should_compute


@register_step_cache(
    "taylorseer", "taylorseer:INTERVAL[:WARMUP] (integers, INTERVAL >= 1, WARMUP >= 1, default 3)"
)
class _TaylorSeer:
    @staticmethod
    def parse(words: list[str]) -> tuple[float, ...]:
        interval, *rest = words
        warmup = rest[0] if rest else "3"
        if len(rest) > 1 or int(interval) < 1 or int(warmup) < 0:
            raise ValueError
        if int(warmup) == 0:
            raise _Refused(
                "WARMUP 0 would predict a request's first call from nothing, and under the prefix KV cache that "
                "call (extract) fills the cache; give WARMUP >= 1"
            )
        return (int(interval), int(warmup))

    @staticmethod
    def config(values: tuple[float, ...], dtype: torch.dtype) -> Any:
        from diffusers import TaylorSeerCacheConfig

        interval, warmup = (int(value) for value in values)
        return TaylorSeerCacheConfig(
            cache_interval=interval, disable_cache_before_step=warmup, taylor_factors_dtype=dtype
        )

    @staticmethod
    def skipped(state: Any) -> bool:
        return bool(state.last_update_step != state.current_step)  # predicted: no update at this call


def parse_step_cache(text: str, flag: str = CACHE_FLAG, allow_auto: bool = False) -> StepCacheSpec | None:
    """``--cache``'s words as a setting (None for ``auto``, where ``allow_auto``); anything else is refused in one
    line naming ``flag`` (none: argparse names it)."""
    text = text.strip()
    said = f"{flag} {text}" if flag else text
    if text == AUTO:
        if allow_auto:
            return None
        raise InputError(
            f"{said}: only ditq sweep and ditq demo search a setting; give one ({_SYNTAX})", field="cache"
        )
    kind, _, rest = text.partition(":")
    if kind == "mag":
        raise InputError(
            f"{said}: MagCache needs magnitude ratios calibrated for this model and step count, which ditq does "
            f"not measure; use {_SYNTAX}",
            field="cache",
        )
    if kind not in STEP_CACHE_KINDS:
        raise InputError(f"{said}: not a step cache (use {_SYNTAX})", field="cache")
    entry = STEP_CACHE_KINDS[kind]
    try:
        values = entry.parse(rest.split(":") if rest else [])
    except _Refused as error:
        raise InputError(f"{said}: {error}", field="cache") from None
    except ValueError:
        raise InputError(f"{said}: expected {entry.syntax}", field="cache") from None
    return StepCacheSpec(kind, values)


class StepCacheRun:
    """The step cache installed on one transformer: each call's cache context, and what each request skipped."""

    def __init__(self, transformer: torch.nn.Module, spec: StepCacheSpec) -> None:
        self.transformer, self.spec = transformer, spec
        self._skipped = STEP_CACHE_KINDS[spec.kind].skipped
        self._enable()
        self._open: Any = None  # the context manager of the call running now
        self._prefetch_pending = False
        self.calls: list[
            bool
        ] = []  # this request's transformer calls: whether each was served from the cache
        self._handles: list[RemovableHandle] = [
            transformer.register_forward_pre_hook(self._enter, with_kwargs=True),
            transformer.register_forward_hook(self._exit, always_call=True),
        ]

    def _enable(self) -> None:
        """diffusers' hooks registered (outside every hook already on a block: the last registered runs first), and
        the state this run reads after each call."""
        # the compute dtype (diffusers' first floating parameter: never a quantized weight)
        dtype: torch.dtype = self.transformer.dtype  # type: ignore[assignment]
        self.transformer.enable_cache(STEP_CACHE_KINDS[self.spec.kind].config(self.spec.values, dtype))  # type: ignore[operator]
        # the first hook's state (diffusers keeps one per hook, or one shared by a kind's hooks): every hook of a
        # kind decides alike at a call
        self._state = hook_states(self.transformer)[0]

    def wrap_outermost(self) -> None:
        """The hooks registered again, outside the hooks added to the blocks since: a transformer that began to
        stream after the cache was installed (``Placement.demote``) copies no weights of a block the cache skips,
        as one that streamed from the start does. Between requests: the state of the last one is dropped."""
        self.transformer.disable_cache()  # type: ignore[operator]
        self._enable()

    @property
    def skipped_steps(self) -> int:
        return sum(self.calls)

    def begin(self) -> None:
        """A request begins: the hooks' state of the last one dropped (a cancelled one never reset it)."""
        from diffusers.hooks import HookRegistry

        HookRegistry.check_if_exists_or_initialize(self.transformer).reset_stateful_hooks()
        self.calls = []

    def _enter(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        # group offload with streams removes its trackers at the end of this call, cutting the block hooks
        # registered after them out: mended in _exit (``ditq.runtime.diffusers_hooks.reconnect_cut_hooks``)
        self._prefetch_pending = prefetch_pending(self.transformer)
        stage = "prefix" if kwargs.get("kv_cache_mode") == "extract" else "denoise"
        outer = _open_context(self._state)  # the pipeline's own (Qwen-Image-2.1's: cond | uncond), if any
        name = stage if outer is None else f"{outer.name}/{stage}"
        self._open = self.transformer.cache_context(name)  # type: ignore[operator]
        self._open.__enter__()

    def _exit(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._prefetch_pending and not prefetch_pending(self.transformer):
            reconnect_cut_hooks(self.transformer)
        self._prefetch_pending = False
        if self._open is None:
            return
        try:
            self.calls.append(self._skipped(self._state.get_state()))
        finally:
            self._open.__exit__(None, None, None)
            self._open = None

    def remove(self) -> None:
        """The hooks gone: the transformer runs every step again."""
        for handle in self._handles:
            handle.remove()
        self.transformer.disable_cache()  # type: ignore[operator]


def _open_context(state: Any) -> Any:
    """The cache context a hook's ``StateManager`` is in, or None: its public ``context`` raises ValueError for
    none."""
    try:
        return state.context
    except ValueError:
        return None


def install_step_cache(pipeline: Any, text: str) -> StepCacheRun:
    """``--cache TEXT`` on ``pipeline``'s transformer through diffusers' own hooks; the run is
    ``pipeline.ditq_step_cache`` (the adapter begins each request with it and reads its count)."""
    from ditq.runtime.models import model_family

    spec = parse_step_cache(text)
    assert spec is not None, "--cache auto is the sweep's search, never installed"
    transformer = getattr(pipeline, "transformer", None)
    family = model_family(transformer)
    if transformer is None or family is None:
        raise InputError(
            f"{CACHE_FLAG} {spec}: {type(transformer).__name__} has no step cache in ditq (Qwen-Image-2.1 has)",
            field="cache",
        )
    family.register_cache_blocks()
    run = StepCacheRun(transformer, spec)
    pipeline.ditq_step_cache = run
    return run
