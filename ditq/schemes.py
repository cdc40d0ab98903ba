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
from typing import TYPE_CHECKING, Final, Literal

from ditq.errors import InputError

if (
    TYPE_CHECKING
):  # a scheme names its dtype; torch is imported when it is asked for (`--help` needs no torch)
    import torch

__all__ = [
    "CHANNEL",
    "FP8",
    "SCHEMES",
    "W4A8",
    "W4A16",
    "W8A8",
    "W8A16",
    "ActivationKind",
    "GroupSize",
    "Scheme",
    "get_scheme",
    "normalize_quant_method",
    "parse_group_size",
]

ActivationKind = Literal["int8", "fp8"]
# ``--group-size`` (``group_size=`` in Python): N input features per scale, or CHANNEL, one scale per output channel
# (a Scheme's ``group_size`` None); where it is not given (None), the scheme's own
CHANNEL: Final = "channel"
GroupSize = int | Literal["channel"]
_GROUP_SIZES = f"a positive number of input features per scale, or {CHANNEL!r}"  # what --group-size takes


@dataclass(frozen=True)
class Scheme:
    """One quantization preset.

    Weights are symmetric and static, ``num_bits`` wide (8, or 4 for int weights
    packed eight to an int32); ``group_size`` None means one scale per output
    channel. ``activations`` None means activations stay in their source dtype
    (weight-only); otherwise they are quantized dynamically per token.
    """

    name: str
    description: str
    weight_dtype_name: Literal["int8", "float8_e4m3fn"]  # torch's name of the stored weights' dtype
    weight_type: Literal["int", "float"]
    format: Literal["pack-quantized", "int-quantized", "float-quantized"]
    activations: ActivationKind | None
    group_size: int | None = None
    num_bits: Literal[4, 8] = 8
    # the scheme a component's token embedding (its ``get_input_embeddings()``) is stored in under this one, one
    # scale per row (``ditq.quantization.targets.token_embedding``); None: the embedding stays in source precision
    embedding: Literal["w8a16"] | None = None

    def __post_init__(self) -> None:
        if self.group_size is not None and self.group_size <= 0:
            raise InputError(f"group size must be positive, got {self.group_size}")
        if self.group_size is not None and self.activations is not None and self.num_bits == 8:
            raise InputError(f"scheme {self.name}: --group-size applies to w8a16 and the 4-bit schemes only")
        if self.num_bits == 4 and (self.weight_type != "int" or self.format != "pack-quantized"):
            raise InputError(f"scheme {self.name}: 4-bit weights are int, stored pack-quantized")

    @property
    def weight_dtype(self) -> torch.dtype:
        import torch

        dtype: torch.dtype = getattr(torch, self.weight_dtype_name)
        return dtype

    @property
    def weight_qmax(self) -> float:
        """Largest magnitude a quantized weight is scaled to (127, 7 for 4 bits, or 448); symmetric, so int
        weights use -qmax..qmax (stored 4-bit values from other tools may also hold -8, which reads exactly)."""
        import torch

        if self.weight_type == "int":
            return float(2 ** (self.num_bits - 1) - 1)
        return float(torch.finfo(torch.float8_e4m3fn).max)

    @property
    def weight_strategy(self) -> Literal["channel", "group"]:
        return "channel" if self.group_size is None else "group"

    @property
    def guarded_group_size(self) -> int | None:
        """The group size a layer's in_features must be a multiple of to be quantized at all: 8-bit groups (a layer
        they do not divide stays in source precision); None for 4 bits, whose layers fall back to per-channel
        scales (``fitted``)."""
        return self.group_size if self.num_bits == 8 else None

    def fitted(self, in_features: int) -> Scheme:
        """This scheme for a layer of ``in_features``: 4-bit groups that do not divide it become one scale per
        output channel, and so does one group as wide as the row (the same numbers, stored as what they are: a
        reader tells groups from channels by the scale's columns); otherwise unchanged."""
        g = self.group_size
        if self.num_bits == 4 and g is not None and (in_features % g or in_features == g):
            return self.with_group_size(None)
        return self

    def grouped(self, group_size: GroupSize) -> Scheme:
        """This scheme with a ``--group-size``: N input features per scale, or ``CHANNEL`` (every scheme's 8-bit
        default; for the 4-bit schemes one scale per output channel instead of groups of 128)."""
        if group_size == CHANNEL:
            return self.with_group_size(None)
        if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size <= 0:
            raise InputError(f"--group-size {group_size!r}: {_GROUP_SIZES}")
        return self.with_group_size(group_size)

    @property
    def group_size_option(self) -> GroupSize | None:
        """The ``--group-size`` that makes this scheme of its preset: None where it is the preset's own."""
        if self.group_size == SCHEMES[self.name].group_size:
            return None
        return CHANNEL if self.group_size is None else self.group_size

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
            num_bits=self.num_bits,
            embedding=self.embedding,
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

# 4-bit: int4 weights in groups of 128 input channels (one scale per output channel where a layer's in_features is
# not a multiple of 128), packed eight to an int32 as compressed-tensors packs them. The token embedding is stored
# as w8a16 stores a Linear, one int8 scale per row (per-row SQNR about 41 dB; int4 rows in groups of 128 about 19 dB
# for 0.29 GB less at Qwen3-VL-8B's table: benchmarks/embedding_error.py); the 8-bit schemes keep it in source
# precision.
FOUR_BIT_GROUP_SIZE = 128
W4A16 = Scheme(
    name="w4a16",
    description="int4 weights, symmetric, groups of 128; activations untouched",
    weight_dtype_name="int8",
    weight_type="int",
    format="pack-quantized",
    activations=None,
    group_size=FOUR_BIT_GROUP_SIZE,
    num_bits=4,
    embedding="w8a16",
)
W4A8 = Scheme(
    name="w4a8",
    description="int4 weights, symmetric, groups of 128 + dynamic per-token fp8 activations (W4AFP8)",
    weight_dtype_name="int8",
    weight_type="int",
    format="pack-quantized",
    activations="fp8",
    group_size=FOUR_BIT_GROUP_SIZE,
    num_bits=4,
    embedding="w8a16",
)

SCHEMES: dict[str, Scheme] = {s.name: s for s in (W8A16, W8A8, FP8, W4A16, W4A8)}

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
    "w4a16": "w4a16",
    "int4wo": "w4a16",
    "int4-wo": "w4a16",
    "int4-weight-only": "w4a16",
    "int4_weight_only": "w4a16",
    "w4a16-int": "w4a16",
    "w4a8": "w4a8",
    "w4afp8": "w4a8",
    "w4a8-fp8": "w4a8",
}


# Names that fit more than one scheme: each is named, none guessed.
_INT8_BOTH = "w8a16 (int8 weights, activations untouched) or w8a8 (int8 weights and activations)"
_INT4_BOTH = "w4a16 (int4 weights, activations untouched) or w4a8 (int4 weights, fp8 activations)"
_AMBIGUOUS: dict[str, str] = {
    "int8": _INT8_BOTH,
    "w8": _INT8_BOTH,
    "8bit": _INT8_BOTH + ", or fp8",
    "int4": _INT4_BOTH,
    "w4": _INT4_BOTH,
    "4bit": _INT4_BOTH,
}
# Calibrations, not formats: their 4-bit weights are w4a16's, rounded with error feedback.
_CALIBRATIONS = re.compile(r"gptq|awq")

# Names of formats ditq does not implement (NVFP4, MXFP4, NF4, W4A4, other widths, kernels' names...): refused as
# what they are, not answered with the nearest name.
_UNSUPPORTED = re.compile(r"fp4|nf4|a4|mxfp6|fp6|int2|w2|w3|int3|marlin")


def parse_group_size(text: str) -> GroupSize:
    """``--group-size``'s value: a positive integer, or ``channel``."""
    key = text.strip().lower()
    if key == CHANNEL:
        return CHANNEL
    if key.isdigit() and int(key) > 0:
        return int(key)
    hint = f"; did you mean {CHANNEL!r}?" if difflib.get_close_matches(key, [CHANNEL], cutoff=0.6) else ""
    raise InputError(f"--group-size {text!r}: {_GROUP_SIZES} (one scale per output channel){hint}")


def get_scheme(name: str, group_size: GroupSize | None = None) -> Scheme:
    """The scheme for a name or alias (case-insensitive), with ``group_size`` (``Scheme.grouped``) where one is
    given; an unknown name says what it may have meant."""
    key = name.strip().lower()
    if key not in _ALIASES and _CALIBRATIONS.search(key):
        raise InputError(
            f"scheme {name!r} names a calibration, not a format: use --scheme w4a16 or w4a8 with --calibrate gptq"
        )
    if key not in _ALIASES and _UNSUPPORTED.search(key):
        raise InputError(
            f"scheme {name!r}: ditq implements {', '.join(SCHEMES)}; other formats and widths are not supported"
        )
    if key in _AMBIGUOUS:
        raise InputError(f"scheme {name!r} fits more than one scheme: {_AMBIGUOUS[key]}; choose one")
    if key not in _ALIASES:
        close = difflib.get_close_matches(key, list(_ALIASES), n=1, cutoff=0.5)
        hint = f"; did you mean {_ALIASES[close[0]]!r}?" if close else ""
        raise InputError(f"unknown scheme {name!r} (known: {', '.join(SCHEMES)}){hint}")
    scheme = SCHEMES[_ALIASES[key]]
    return scheme if group_size is None else scheme.grouped(group_size)


def normalize_quant_method(method: str) -> str:
    """Both spellings of compressed-tensors resolve to the one in serialized configs."""
    key = method.strip().lower().replace("_", "-")
    if key == "compressed-tensors":
        return "compressed-tensors"
    raise InputError(f"unsupported quantization method {method!r} (ditq reads and writes compressed-tensors)")
