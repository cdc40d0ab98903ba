"""How a pipeline is opened, as one value: ``LoadOptions``, validated when it is built and resolved once.

Every command that loads a model (serve, generate, baseline, plan, the sweep's servers) and the Python API
(``ditq.load_pipeline``) hand one ``LoadOptions`` to the one opener (``ditq.pipeline.open.open_pipeline``), as
torchao hands one config to ``quantize_``. Its words are the command line's: a field is named as its flag
(``offload`` is ``--offload``), and an error names the flag in one line.

``resolve_load_options`` turns the words into things once, in one place: ``auto`` becomes a device, no dtype
becomes the device's default, and ``max_memory`` becomes a cap on the CUDA allocator (``ditq.runtime.memory_cap``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ditq.devices import (
    DTYPE_CHOICES,
    OFFLOAD_MODES,
    check_device_name,
    parse_memory_size,
    resolve_device,
    resolve_dtype,
)
from ditq.errors import InputError

if TYPE_CHECKING:
    import torch

    from ditq.runtime.memory_cap import MemoryCap

__all__ = ["LoadOptions", "ResolvedLoad", "resolve_load_options"]


def _choices() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Field -> (what it is, the words it accepts), read where each is defined (imported here, not at module
    import: they import torch)."""
    from ditq.kernels.attention.reference import ATTENTION_KINDS
    from ditq.kernels.registry import ACCUMULATE_MODES
    from ditq.runtime.compile import COMPILE_BACKENDS
    from ditq.runtime.kv_cache import KV_CACHE_KINDS

    return {
        "dtype": ("a compute dtype", DTYPE_CHOICES),
        "offload": ("an offload mode", OFFLOAD_MODES),
        "attention": ("an attention kind", (*ATTENTION_KINDS, "auto")),
        "kv_cache": ("a KV cache kind", KV_CACHE_KINDS),
        "compile": ("a compile backend", COMPILE_BACKENDS),
        "accumulate": ("an accumulation", ACCUMULATE_MODES),
    }


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class LoadOptions:
    """Every choice of how a pipeline is opened. Defaults are the command line's."""

    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str | None = None  # the compute dtype's name; None: float32 on the CPU, bfloat16 on CUDA
    offload: str = "none"  # none | auto | model | block (ditq.runtime.offload)
    max_memory: str | None = None  # a SIZE (24GiB): the process's cap on its CUDA device
    # what --offload auto places the weights within (None: the allocator's cap under max_memory, else free memory)
    memory_budget_bytes: int | None = None
    variant: str | None = None  # weight files' variant (fp16...); None: the one an artifact records
    skip_doctor: bool = False  # kernel paths unverified: the registry's first candidate
    accumulate: str = "exact"  # exact | fast (fp8 fast accumulation, where the doctor measures it)
    attention: str | None = None  # int8 | fp8 | int8-fp8 | fp8-fp8 | auto; None: the model's own
    kv_cache: str | None = None  # int8 | fp8; None: the model's own prefix KV cache
    compile: str | None = None  # a torch.compile backend; None: eager
    # a diffusers step cache (``ditq.runtime.step_cache``: first-block:T, taylorseer:N[:W]; auto, the sweep's
    # search); None: every step computed
    cache: str | None = None
    fuse: bool = False  # quantized projections that read one input as one GEMM (ditq.runtime.fuse)
    drop_unused: bool = True  # leave out the modules an artifact's manifest declares unused
    local_files_only: bool = False  # a hub id: from the cache only
    # the Python API's own kernel chooser (``ditq.load_pipeline(chooser=...)``); None: the doctor's, or with
    # skip_doctor the registry's first candidate. Not a word of the command line, so never recorded.
    chooser: Callable[..., Any] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        check_device_name(self.device, _flag("device"))
        for name, (what, allowed) in _choices().items():
            value = getattr(self, name)
            if value is not None and value not in allowed:
                raise InputError(
                    f"{_flag(name)} {value!r}: not {what} (choose from {', '.join(allowed)})", field=name
                )
        if self.max_memory is not None:
            parse_memory_size(self.max_memory)
        if self.memory_budget_bytes is not None and self.memory_budget_bytes <= 0:
            raise InputError(f"memory_budget_bytes: must be positive, got {self.memory_budget_bytes}")
        if self.cache is not None:
            self._check_cache()
        if self.skip_doctor and self.accumulate == "fast":
            raise InputError(
                "--accumulate fast: fast accumulation serves only where the kernel doctor measured it; drop --skip-doctor",
                field="accumulate",
            )

    def _check_cache(self) -> None:
        from ditq.runtime.step_cache import CACHE_FLAG, parse_step_cache

        spec = parse_step_cache(str(self.cache), allow_auto=True)
        if spec is not None:  # one spelling in every record (first-block:0.10 is first-block:0.1)
            object.__setattr__(self, "cache", str(spec))
        if self.compile is not None:
            raise InputError(
                f"{CACHE_FLAG} {self.cache} with --compile: not supported (diffusers' cache hooks decide each step in "
                "Python, around the compiled blocks)",
                field="cache",
            )

    def replace(self, **changes: Any) -> LoadOptions:
        """A copy with ``changes``, validated again."""
        return dataclasses.replace(self, **changes)

    def record(self, *names: str) -> dict[str, Any]:
        """The options as a run file states them: the fields ``names`` (a file's own; none: every field but the
        Python API's chooser), so that a record that keeps its fields on disk is built from this value."""
        fields = [f.name for f in dataclasses.fields(self) if f.name != "chooser"]
        unknown = sorted(set(names) - set(fields))
        assert not unknown, f"not LoadOptions fields: {unknown}"
        return {name: getattr(self, name) for name in names or fields}


@dataclass(frozen=True)
class ResolvedLoad:
    """``LoadOptions`` made concrete on this machine: its ``device`` and ``dtype`` are the words with ``auto`` and
    the default resolved (``options.device`` is ``str(device)``), and ``memory_cap`` the cap in force."""

    options: LoadOptions
    device: torch.device
    dtype: torch.dtype
    memory_cap: MemoryCap | None = None
    allocator: str | None = None  # the CUDA allocator's configuration where ditq manages the fit (memory_cap)

    @property
    def memory_budget_bytes(self) -> int | None:
        """What ``--offload auto`` places the weights within: the cap's allocator share, else the options'."""
        if self.memory_cap is not None:
            return self.memory_cap.allocator_bytes
        return self.options.memory_budget_bytes


def resolve_load_options(options: LoadOptions) -> ResolvedLoad:
    """The one place ``auto`` becomes a device and no dtype the device's default; with ``max_memory`` the cap is
    applied to the CUDA device (once: resolve once per process that loads)."""
    from ditq.runtime.memory_cap import apply_memory_cap, expandable_segments

    device = resolve_device(options.device)
    dtype = resolve_dtype(options.dtype, device)
    managed = options.offload == "auto" or options.max_memory is not None
    allocator = expandable_segments(device, managed)  # before the cap's first allocation starts the allocator
    cap = apply_memory_cap(options.max_memory, str(device))
    if cap is not None:  # the budget is per device: the cap names the one it holds (cuda:N)
        device = resolve_device(cap.device)
    dtype_name = str(dtype).removeprefix("torch.")
    return ResolvedLoad(options.replace(device=str(device), dtype=dtype_name), device, dtype, cap, allocator)
