"""Quantization schemes as data, with the names people and other tools use for them.

A scheme says how weights are quantized (and into which compressed-tensors
format they are stored: ``format``) and how activations are treated at run
time. What each format stores per quantized Linear is its codec's
(``ditq.checkpoint.codecs``).
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from ditq.errors import InputError

if (
    TYPE_CHECKING
):  # a scheme names its dtype; torch is imported when it is asked for (`--help` needs no torch)
    import torch

__all__ = [
    "FP8",
    "SCHEMES",
    "W8A8",
    "W8A16",
    "ActivationKind",
    "Scheme",
    "get_scheme",
    "normalize_quant_method",
]

ActivationKind = Literal["int8", "fp8"]


@dataclass(frozen=True)
class Scheme:
    """One 8-bit quantization preset.

    Weights are symmetric and static; ``group_size`` None means one scale per
    output channel. ``activations`` None means activations stay in their source
    dtype (weight-only); otherwise they are quantized dynamically per token.
    """

    name: str
    description: str
    weight_dtype_name: Literal["int8", "float8_e4m3fn"]  # torch's name of the stored weights' dtype
    weight_type: Literal["int", "float"]
    format: Literal["pack-quantized", "int-quantized", "float-quantized"]
    activations: ActivationKind | None
    group_size: int | None = None

    def __post_init__(self) -> None:
        if self.group_size is not None and self.group_size <= 0:
            raise InputError(f"group size must be positive, got {self.group_size}")
        if self.group_size is not None and self.activations is not None:
            raise InputError(f"scheme {self.name}: --group-size applies to weight-only w8a16 only")

    @property
    def weight_dtype(self) -> torch.dtype:
        import torch

        dtype: torch.dtype = getattr(torch, self.weight_dtype_name)
        return dtype

    @property
    def weight_qmax(self) -> float:
        """Largest representable magnitude of a stored weight value (127 or 448)."""
        import torch

        return 127.0 if self.weight_type == "int" else float(torch.finfo(torch.float8_e4m3fn).max)

    @property
    def weight_strategy(self) -> Literal["channel", "group"]:
        return "channel" if self.group_size is None else "group"

    def with_group_size(self, group_size: int | None) -> Scheme:
        """A copy with another group size (validated)."""
        return Scheme(
            name=self.name,
            description=self.description,
            weight_dtype_name=self.weight_dtype_name,
            weight_type=self.weight_type,
            format=self.format,
            activations=self.activations,
            group_size=group_size,
        )


W8A16 = Scheme(
    name="w8a16",
    description="int8 weights, symmetric, per output channel; activations untouched",
    weight_dtype_name="int8",
    weight_type="int",
    format="pack-quantized",
    activations=None,
)
W8A8 = Scheme(
    name="w8a8",
    description="int8 weights per output channel + dynamic symmetric per-token int8 activations",
    weight_dtype_name="int8",
    weight_type="int",
    format="int-quantized",
    activations="int8",
)
FP8 = Scheme(
    name="fp8",
    description="float8_e4m3fn weights per output channel + dynamic per-token fp8 activations",
    weight_dtype_name="float8_e4m3fn",
    weight_type="float",
    format="float-quantized",
    activations="fp8",
)

SCHEMES: dict[str, Scheme] = {s.name: s for s in (W8A16, W8A8, FP8)}

_ALIASES: dict[str, str] = {
    "w8a16": "w8a16",
    "int8wo": "w8a16",
    "int8-wo": "w8a16",
    "int8-weight-only": "w8a16",
    "int8_weight_only": "w8a16",
    "w8a8": "w8a8",
    "w8a8dyn": "w8a8",
    "w8a8-dynamic": "w8a8",
    "int8dq": "w8a8",
    "int8-dynamic": "w8a8",
    "fp8": "fp8",
    "fp8-dynamic": "fp8",
    "fp8_dynamic": "fp8",
    "w8a8-fp8": "fp8",
}


# Names that fit more than one scheme: each is named, none guessed.
_INT8_BOTH = "w8a16 (int8 weights, activations untouched) or w8a8 (int8 weights and activations)"
_AMBIGUOUS: dict[str, str] = {"int8": _INT8_BOTH, "w8": _INT8_BOTH, "8bit": _INT8_BOTH + ", or fp8"}

# Names of schemes of another width (NVFP4, MXFP4, W4A16, int4, NF4, GPTQ/AWQ's 4-bit...): refused as what they are,
# not answered with the nearest 8-bit name.
_NOT_8_BIT = re.compile(r"fp4|int4|nf4|w4|a4|4bit|mxfp6|fp6|int2|w2|w3|int3|gptq|awq|marlin")


def get_scheme(name: str, group_size: int | None = None) -> Scheme:
    """The scheme for a name or alias (case-insensitive); an unknown name says what it may have meant."""
    key = name.strip().lower()
    if key not in _ALIASES and _NOT_8_BIT.search(key):
        raise InputError(
            f"scheme {name!r}: ditq implements 8-bit schemes only ({', '.join(SCHEMES)}); "
            "4-bit and other widths are not supported"
        )
    if key in _AMBIGUOUS:
        raise InputError(f"scheme {name!r} fits more than one scheme: {_AMBIGUOUS[key]}; choose one")
    if key not in _ALIASES:
        close = difflib.get_close_matches(key, list(_ALIASES), n=1, cutoff=0.5)
        hint = f"; did you mean {_ALIASES[close[0]]!r}?" if close else ""
        raise InputError(f"unknown scheme {name!r} (known: {', '.join(SCHEMES)}){hint}")
    scheme = SCHEMES[_ALIASES[key]]
    return scheme if group_size is None else scheme.with_group_size(group_size)


def normalize_quant_method(method: str) -> str:
    """Both spellings of compressed-tensors resolve to the one in serialized configs."""
    key = method.strip().lower().replace("_", "-")
    if key == "compressed-tensors":
        return "compressed-tensors"
    raise InputError(f"unsupported quantization method {method!r} (ditq reads and writes compressed-tensors)")
