"""Where a command computes and in what precision: the one resolver of ``--device``, ``--dtype`` and ``--offload``.

Every command takes its choices and defaults from here, so ``ditq generate``, ``ditq serve``, the quantizer,
the doctor and the sweep read the same words the same way:

- device: ``auto`` (the CUDA device when there is one, else the CPU), ``cpu``, ``cuda`` (the current CUDA
  device) or ``cuda:N``;
- dtype: what the unquantized parts and the activations compute in; by default float32 on the CPU
  (bfloat16 matmuls there are many times slower) and bfloat16 on an accelerator;
- offload: where the weights wait while a pipeline runs (``ditq.runtime.offload`` applies it).

Errors are one line naming the option, e.g. ``--device cuda:3: this machine has 1 CUDA device``. torch is imported
when a device or dtype is resolved, not with this module: every command's ``--help`` reads its choices from here.
"""

from __future__ import annotations

import argparse
import re
from typing import TYPE_CHECKING, Any

from ditq.errors import InputError

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEVICE_CHOICES",
    "DTYPES",  # noqa: F822 -- built on first use (``__getattr__``): torch loads then
    "DTYPE_CHOICES",
    "OFFLOAD_LADDER_AUTO",
    "OFFLOAD_MODES",
    "add_device_arguments",
    "check_device_name",
    "default_dtype",
    "parse_memory_size",
    "parse_offload",
    "resolve_device",
    "resolve_dtype",
    "resolve_offload",
]

# What --device accepts (cuda:N for any N below the device count); shown in --help and in errors.
DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:N")
DTYPE_CHOICES = ("bfloat16", "float16", "float32")  # DTYPES' keys: the compute dtypes, by torch's names
# The compute dtype when --dtype is not given, per device type.
_DEFAULT_DTYPES = {"cpu": "float32", "cuda": "bfloat16"}
# none: every component on the device; auto: placed by how often each runs (the denoiser resident first, the
# rest streamed from pinned host memory where the budget needs it; ``ditq.runtime.offload.Placement``); model:
# one component at a time; block: every component's blocks stream
OFFLOAD_MODES = ("none", "auto", "model", "block")
# The sweep's --offload auto ladder: placed by run frequency, then block offload for what still does not fit.
OFFLOAD_LADDER_AUTO = ("auto", "block")

_DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:[0-9]+)?")


def __getattr__(name: str) -> Any:
    """``DTYPES`` (name -> torch.dtype, the names of DTYPE_CHOICES), built on first use: torch loads then."""
    if name == "DTYPES":
        import torch

        return {choice: getattr(torch, choice) for choice in DTYPE_CHOICES}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def check_device_name(device: str | torch.device, option: str = "--device") -> str:
    """``device`` as text, refused in one line where it is none of DEVICE_CHOICES' forms (nothing is resolved:
    whether it exists here is ``resolve_device``'s question)."""
    text = str(device).strip()
    if not _DEVICE_PATTERN.fullmatch(text):
        raise InputError(f"{option} {text!r}: not a device (choose from {', '.join(DEVICE_CHOICES)})")
    return text


def resolve_device(device: str | torch.device, option: str = "--device") -> torch.device:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N`` as a torch.device that exists here."""
    import torch

    text = check_device_name(device, option)
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(text)
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError(f"{option} {text}: no CUDA device is available here")
        count = torch.cuda.device_count()
        if resolved.index is not None and resolved.index >= count:
            raise InputError(f"{option} {text}: this machine has {count} CUDA device{'s' * (count != 1)}")
    return resolved


def default_dtype(device: str | torch.device) -> str:
    """The compute dtype's name when none is given: float32 on the CPU, bfloat16 on CUDA."""
    import torch

    return _DEFAULT_DTYPES[torch.device(device).type]


def resolve_dtype(
    dtype: str | torch.dtype | None, device: str | torch.device, option: str = "--dtype"
) -> torch.dtype:
    """A dtype name (or a torch.dtype) as a torch.dtype; None is the default for ``device``'s type."""
    import torch

    dtypes: dict[str, torch.dtype] = __getattr__("DTYPES")
    if isinstance(dtype, torch.dtype):
        if dtype not in dtypes.values():
            raise InputError(
                f"{option} {dtype}: not a compute dtype (choose from {', '.join(DTYPE_CHOICES)})"
            )
        return dtype
    name = default_dtype(device) if dtype is None else dtype
    if name not in dtypes:
        raise InputError(f"{option} {name!r}: not a compute dtype (choose from {', '.join(DTYPE_CHOICES)})")
    return dtypes[name]


_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}


def parse_memory_size(text: str) -> int:
    """'24GiB', '24GB', '20000MiB', '1.5g' or a byte count -> bytes."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise InputError(f"--max-memory: cannot read '{text}' as a size (examples: 24GiB, 24GB, 20000MiB)")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise InputError(f"--max-memory: size must be positive, got '{text}'")
    return size


def parse_offload(value: str) -> tuple[str, ...]:
    """A sweep's ``--offload``: one mode, a comma list tried in order (a ladder), or ``auto`` (the auto placement,
    then block); each mode is checked where the ladder is (``ditq.sweep.SweepOptions``)."""
    return (
        OFFLOAD_LADDER_AUTO
        if value.strip() == "auto"
        else tuple(m.strip() for m in value.split(",") if m.strip())
    )


def resolve_offload(mode: str, option: str = "--offload") -> str:
    """One of OFFLOAD_MODES, checked."""
    if mode not in OFFLOAD_MODES:
        raise InputError(f"{option} {mode!r}: not an offload mode (choose from {', '.join(OFFLOAD_MODES)})")
    return mode


def add_device_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    device: str,
    what: str,
    dtype: bool = False,
    offload: bool = False,
) -> None:
    """``--device`` with its default (and ``--dtype`` / ``--offload`` when asked), choices from this module.

    ``--dtype`` defaults to None, read as ``default_dtype`` of the resolved device.
    """
    parser.add_argument(
        "--device",
        default=device,
        metavar="{" + ",".join(DEVICE_CHOICES) + "}",
        help=f"{what} (default: {device}; auto: cuda when there is a CUDA device, else cpu)",
    )
    if dtype:
        parser.add_argument(
            "--dtype",
            choices=DTYPE_CHOICES,
            default=None,
            help="compute dtype of the unquantized parts and the activations (default: "
            f"{_DEFAULT_DTYPES['cpu']} on cpu, where bfloat16 matmuls are many times slower; "
            f"{_DEFAULT_DTYPES['cuda']} on cuda)",
        )
    if offload:
        parser.add_argument(
            "--offload",
            choices=OFFLOAD_MODES,
            default="none",
            help="where weights wait while the pipeline runs: none (all on the device), auto (the per-step model "
            "resident, the rest streamed from pinned host memory where the memory budget needs it), model (each "
            "component moved in whole when it runs), block (blocks streamed) (default: none)",
        )
