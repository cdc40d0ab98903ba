"""One codec per compressed-tensors format: what a quantized Linear stores, and how it is encoded, read,
decoded and recognised.

As compressed-tensors' ``BaseCompressor`` registry gives each format one class (``compression_param_info``,
``compress_weight``, ``decompress_weight``), each format here is one registered ``Codec``:

| format          | scheme | tensors (``<prefix>.`` + name), in file order                                       |
| pack-quantized  | w8a16  | weight_packed int32 (out, ceil(in/4)), weight_scale f32 (out, 1 or in/g), weight_shape int64 (2,) |
| pack-quantized  | w4a16, w4a8 | weight_packed int32 (out, ceil(in/8)), weight_scale f32 (out, 1 or in/g), weight_shape int64 (2,) |
| int-quantized   | w8a8   | weight int8 (out, in), weight_scale f32 (out, 1)                                     |
| float-quantized | fp8    | weight float8_e4m3fn (out, in), weight_scale f32 (out, 1)                            |

The quantizer, verifier, loader, QuantizedLinear, kernel paths and doctor all ask this module; the arithmetic
is ``ditq.numerics``. Recognising a checkpoint's schemes (from its tensors' names and dtypes, or from its
``quantization_config``) is here too.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch

from ditq.checkpoint.patterns import check_entries
from ditq.errors import InputError
from ditq.numerics import dequantize_weight, pack_int_to_int32, unpack_int32_to_int
from ditq.schemes import FP8, SCHEMES, W4A16, W8A8, W8A16, ActivationKind, Scheme, normalize_quant_method

__all__ = [
    "CODECS",
    "SCALE",
    "SCALE_DTYPES",
    "Codec",
    "ConfigGroup",
    "FloatQuantizedCodec",
    "IntQuantizedCodec",
    "PackQuantizedCodec",
    "StoredSpec",
    "codec_for",
    "config_groups",
    "detect_codec",
    "is_quantized_tensor",
    "layer_scheme",
    "quantized_layers",
    "register_codec",
    "scheme_in_format",
    "scheme_of_config",
    "weight_features",
]

StoredSpec = tuple[torch.dtype, tuple[int, ...]]  # (dtype, shape) of one stored tensor
SCALE = "weight_scale"  # every format stores one; its presence marks a quantized Linear
# ditq writes float32 scales; llm-compressor writes them in the weight's source dtype (bfloat16, float16). Each is
# read as float32 (exact: every bfloat16 and float16 value is a float32 value).
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _present(stored: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in stored:
        raise InputError(f"stored weight lacks {name!r} (has {sorted(stored)})")
    return stored[name]


class Codec(ABC):
    """One stored format. A subclass sets the class attributes and registers with ``@register_codec``."""

    format: ClassVar[str]  # compressed-tensors' name for the format
    scheme: ClassVar[Scheme]  # the ditq preset stored this way (per output channel)
    weight_name: ClassVar[str]  # the tensor that holds the quantized weight values
    num_bits: ClassVar[int] = 8  # the stored values' width

    def with_bits(self, num_bits: int) -> Codec:
        """This format's codec for ``num_bits``-wide values (a format that stores one width refuses others)."""
        if num_bits != self.num_bits:
            raise InputError(f"{self.format} stores {self.num_bits}-bit weights, not {num_bits}-bit")
        return self

    @abstractmethod
    def specs(
        self, out_features: int, in_features: int, group_size: int | None = None
    ) -> dict[str, StoredSpec]:
        """Local name -> (dtype, shape) of every tensor one (out, in) Linear stores, in file order."""

    @abstractmethod
    def encode_values(self, q: torch.Tensor) -> torch.Tensor:
        """q (rows, in) int8|fp8 -> the stored weight tensor's rows (a band encodes like the whole)."""

    @abstractmethod
    def decode_values(self, stored_weight: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        """The stored weight tensor -> q (out, in) int8|fp8 (the tensor itself where nothing needs unpacking)."""

    @abstractmethod
    def features(self, stored: Mapping[str, torch.Tensor]) -> tuple[int, int]:
        """(out, in) of the Linear the stored tensors hold."""

    @abstractmethod
    def matches(self, prefix: str, dtypes: Mapping[str, torch.dtype]) -> bool:
        """Whether the Linear at ``prefix`` is stored in this format (``dtypes``: tensor name -> dtype)."""

    @abstractmethod
    def scheme_for(self, in_features: int, scale_columns: int) -> Scheme:
        """The scheme of a stored Linear whose weight_scale has ``scale_columns`` columns."""

    @property
    def names(self) -> tuple[str, ...]:
        """The stored tensors' local names (they do not depend on the shape)."""
        return tuple(self.specs(0, 0))

    def trailer(self, out_features: int, in_features: int) -> dict[str, torch.Tensor]:
        """Tensors stored after the weight and its scale (none unless the format says otherwise)."""
        return {}

    def encode(self, q: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
        """(q (out, in), scale (out, 1|groups)) -> one Linear's stored tensors, in file order."""
        return {self.weight_name: self.encode_values(q), SCALE: scale, **self.trailer(*q.shape)}

    def read(self, stored: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """One Linear's stored tensors -> (q (out, in) int8|fp8, scale (out, 1|groups) float32), on their device.

        Every tensor is checked against ``specs`` (a scale may be any of ``SCALE_DTYPES``); an error is one line
        naming the tensor.
        """
        out_features, in_features = self.features(stored)
        scale = _present(stored, SCALE)
        rows, columns = scale.shape if scale.ndim == 2 else (0, 0)
        if rows != out_features or not columns or in_features % columns:
            raise InputError(
                f"stored {SCALE!r} {tuple(scale.shape)} does not fit a ({out_features}, {in_features}) weight"
            )
        group_size = self.scheme_for(in_features, columns).group_size
        for name, (dtype, shape) in self.specs(out_features, in_features, group_size).items():
            tensor = _present(stored, name)
            dtypes = SCALE_DTYPES if name == SCALE else (dtype,)
            if tensor.dtype not in dtypes or tuple(tensor.shape) != shape:
                raise InputError(
                    f"stored {name!r} is {tensor.dtype} {tuple(tensor.shape)}, expected {dtype} {shape}"
                )
        q = self.decode_values(stored[self.weight_name], (out_features, in_features))
        return q, scale.to(torch.float32)

    def scale_problem(self, scale: torch.Tensor) -> str | None:
        """Why a stored weight_scale cannot scale this format's weights, or None: every scale is finite,
        positive, and small enough that the largest quantized value times it stays finite in float32 (a scale
        of 3e38 turns every weight into Inf). The one check the loader, verify and the doctor share."""
        scale = scale.to(torch.float32)
        if not bool(torch.isfinite(scale).all()):
            bad = int((~torch.isfinite(scale)).sum())
            return f"{SCALE} holds {bad} NaN or Inf value(s)"
        smallest, largest = float(scale.min()), float(scale.max())
        if smallest <= 0:
            return f"{SCALE} holds {'zero' if smallest == 0 else 'negative'} values (smallest {smallest:g})"
        q_max = self.scheme.weight_qmax
        if largest * q_max > torch.finfo(torch.float32).max:
            return f"{SCALE} {largest:g} is out of range: {q_max:g} times it overflows float32"
        return None

    def decode(self, stored: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """ditq's decoder: one Linear's stored tensors -> its weight (out, in) in ``dtype`` (computed in float32)."""
        return dequantize_weight(*self.read(stored), dtype)


CODECS: dict[str, Codec] = {}  # format -> its codec, in detection order


def register_codec(cls: type[Codec]) -> type[Codec]:
    """Class decorator: ``cls`` is the codec of ``cls.format``."""
    if cls.format in CODECS:
        raise ValueError(f"format {cls.format!r} has two codecs")
    CODECS[cls.format] = cls()
    return cls


def codec_for(scheme: Scheme) -> Codec:
    """The codec of the format ``scheme`` is stored in, for the scheme's width."""
    return CODECS[scheme.format].with_bits(scheme.num_bits)


@register_codec
class PackQuantizedCodec(Codec):
    """w8a16: int8 values biased to bytes, four to an int32 (compressed-tensors' 8-bit packing), plus the shape.
    Its 4-bit sibling (``with_bits(4)``) packs eight values to an int32 the same way."""

    format = "pack-quantized"
    scheme = W8A16
    weight_name = "weight_packed"

    def with_bits(self, num_bits: int) -> Codec:
        codec = PACKED_BY_BITS.get(num_bits)
        if codec is None:
            raise InputError(f"{self.format}: ditq reads 4- and 8-bit packed weights, not {num_bits}-bit")
        return codec

    def specs(
        self, out_features: int, in_features: int, group_size: int | None = None
    ) -> dict[str, StoredSpec]:
        columns = 1 if group_size is None else in_features // group_size
        per_word = 32 // self.num_bits
        return {
            "weight_packed": (torch.int32, (out_features, (in_features + per_word - 1) // per_word)),
            SCALE: (torch.float32, (out_features, columns)),
            "weight_shape": (torch.int64, (2,)),
        }

    def encode_values(self, q: torch.Tensor) -> torch.Tensor:
        return pack_int_to_int32(q, self.num_bits)

    def decode_values(self, stored_weight: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        return unpack_int32_to_int(stored_weight, shape, self.num_bits)

    def trailer(self, out_features: int, in_features: int) -> dict[str, torch.Tensor]:
        return {"weight_shape": torch.tensor([out_features, in_features], dtype=torch.int64)}

    def features(self, stored: Mapping[str, torch.Tensor]) -> tuple[int, int]:
        shape = _present(stored, "weight_shape")
        if shape.dtype != torch.int64 or tuple(shape.shape) != (2,):
            raise InputError(
                f"stored 'weight_shape' is {shape.dtype} {tuple(shape.shape)}, expected torch.int64 (2,)"
            )
        out_features, in_features = (int(v) for v in shape.tolist())
        return out_features, in_features

    def matches(self, prefix: str, dtypes: Mapping[str, torch.dtype]) -> bool:
        return f"{prefix}.weight_packed" in dtypes

    def scheme_for(self, in_features: int, scale_columns: int) -> Scheme:
        return self.scheme.with_group_size(None if scale_columns <= 1 else in_features // scale_columns)


class Pack4QuantizedCodec(PackQuantizedCodec):
    """w4a16 and w4a8: int4 values biased by 8 to nibbles, eight to an int32 (compressed-tensors' 4-bit packing).
    Not registered on its own: it shares the format's name, and the config's ``num_bits`` picks it."""

    scheme = W4A16
    num_bits = 4


PACKED_BY_BITS: dict[int, PackQuantizedCodec] = {8: CODECS["pack-quantized"], 4: Pack4QuantizedCodec()}  # type: ignore[dict-item]


class _UnpackedCodec(Codec):
    """Weights stored as they are quantized (compressed-tensors' naive formats), one scale per output channel."""

    weight_name = "weight"

    def specs(
        self, out_features: int, in_features: int, group_size: int | None = None
    ) -> dict[str, StoredSpec]:
        if group_size is not None:
            raise InputError(f"{self.format}: one scale per output channel, not groups of {group_size}")
        return {
            "weight": (self.scheme.weight_dtype, (out_features, in_features)),
            SCALE: (torch.float32, (out_features, 1)),
        }

    def encode_values(self, q: torch.Tensor) -> torch.Tensor:
        return q

    def decode_values(self, stored_weight: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        return stored_weight

    def features(self, stored: Mapping[str, torch.Tensor]) -> tuple[int, int]:
        weight = _present(stored, "weight")
        if weight.ndim != 2:
            raise InputError(f"stored 'weight' is {weight.dtype} {tuple(weight.shape)}, expected 2 dims")
        return int(weight.shape[0]), int(weight.shape[1])

    def matches(self, prefix: str, dtypes: Mapping[str, torch.dtype]) -> bool:
        return dtypes.get(f"{prefix}.weight") == self.scheme.weight_dtype

    def scheme_for(self, in_features: int, scale_columns: int) -> Scheme:
        return self.scheme  # a grouped scale does not fit ``specs``: the shape checks name it


@register_codec
class IntQuantizedCodec(_UnpackedCodec):
    """w8a8: int8 weights."""

    format = "int-quantized"
    scheme = W8A8


@register_codec
class FloatQuantizedCodec(_UnpackedCodec):
    """fp8: float8_e4m3fn weights."""

    format = "float-quantized"
    scheme = FP8


# What only an already quantized checkpoint holds: stored names besides ``weight`` (and static activation
# scales), and weights in a stored weight dtype.
_QUANTIZED_ONLY_NAMES = frozenset(n for c in CODECS.values() for n in c.names) - {"weight"} | {"input_scale"}
_STORED_WEIGHT_DTYPES = frozenset(c.specs(0, 0)[c.weight_name][0] for c in CODECS.values())


def is_quantized_tensor(name: str, dtype: torch.dtype) -> bool:
    """Whether a tensor of a source checkpoint shows that the checkpoint is already quantized."""
    local = name.rpartition(".")[2]
    return local in _QUANTIZED_ONLY_NAMES or (local == "weight" and dtype in _STORED_WEIGHT_DTYPES)


def weight_features(module: torch.nn.Module) -> tuple[int, int] | None:
    """(out, in) of the weight a quantized module stores: a Linear's (out_features, in_features), a token
    embedding's (num_embeddings, embedding_dim) (its rows are stored as a Linear's output channels, as
    compressed-tensors compresses both: ``COMPRESSIBLE_MODULE_TYPES``); None for any other module."""
    if isinstance(module, torch.nn.Linear):
        return module.out_features, module.in_features
    if isinstance(module, torch.nn.Embedding):
        return module.num_embeddings, module.embedding_dim
    return None


def quantized_layers(names: Iterable[str]) -> dict[str, list[str]]:
    """Prefix of every quantized Linear among tensor names (each stores a weight_scale) -> the local names stored
    for it (``weight`` and every ``weight_*``), both sorted."""
    ordered = sorted(names)
    suffix = f".{SCALE}"
    layers: dict[str, list[str]] = {n[: -len(suffix)]: [] for n in ordered if n.endswith(suffix)}
    for name in ordered:
        prefix, _, local = name.rpartition(".")
        if prefix in layers and (local == "weight" or local.startswith("weight_")):
            layers[prefix].append(local)
    return layers


def detect_codec(prefix: str, dtypes: Mapping[str, torch.dtype], where: str) -> Codec:
    """The codec of the quantized Linear at ``prefix``, from a checkpoint's tensor names -> dtypes."""
    for codec in CODECS.values():
        if codec.matches(prefix, dtypes):
            return codec
    found = dtypes.get(f"{prefix}.weight")
    raise InputError(
        f"{where}: {prefix}.{SCALE} has no int8/fp8 weight or weight_packed beside it ({found or 'none'})"
    )


@dataclass(frozen=True)
class ConfigGroup:
    """One ``config_groups`` entry: the modules it targets (names, ``re:`` patterns or class names) and the
    scheme it describes; ``scheme`` None when no format is pinned (``mixed-precision`` or none): the stored
    tensors then say which format, and the weights and activations still come from the group."""

    name: str
    targets: tuple[str, ...]
    weight_type: str
    activations: ActivationKind | None
    group_size: int | None
    scheme: Scheme | None
    num_bits: int = 8


def _refuse(where: str, group: str, feature: str) -> InputError:
    return InputError(f"{where}: config group {group!r} asks for {feature}, which ditq does not implement")


def _weight_args(weights: Any, where: str, group: str) -> tuple[str, int | None, int]:
    """(type, group size, bits) of a group's ``weights``; anything besides 8-bit (or 4-bit int) symmetric static
    per-channel or per-group scales is refused by name."""
    if not isinstance(weights, dict):
        raise InputError(f"{where}: config group {group!r} has no weights")
    num_bits = weights.get("num_bits")
    if (
        num_bits not in (4, 8)
        or isinstance(num_bits, bool)
        or (num_bits == 4 and weights.get("type") != "int")
    ):
        raise _refuse(
            where,
            group,
            f"{num_bits}-bit {weights.get('type')} weights (ditq reads 8-bit and 4-bit int weights)",
        )
    if not weights.get("symmetric", True):
        raise _refuse(where, group, "weight zero points (asymmetric weights)")
    if weights.get("dynamic"):
        raise _refuse(where, group, "dynamic weight quantization")
    strategy = weights.get("strategy")
    if strategy not in ("channel", "group"):
        raise _refuse(
            where, group, f"{strategy}-strategy weight scales (ditq reads per-channel or per-group)"
        )
    if weights.get("type") not in ("int", "float"):
        raise _refuse(where, group, f"{weights.get('type')} weights")
    if strategy == "channel":
        return str(weights["type"]), None, num_bits
    group_size = weights.get("group_size")
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise InputError(
            f"{where}: config group {group!r}: group-strategy weights need a group_size that is a positive "
            f"integer, got {group_size!r}"
        )
    return str(weights["type"]), group_size, num_bits


def _activation_kind(activations: Any, where: str, group: str) -> ActivationKind | None:
    """None (weight-only) when the group has no ``input_activations``, else the per-token dynamic kind."""
    if activations is None:
        return None
    if not isinstance(activations, dict):
        raise InputError(f"{where}: config group {group!r}: input_activations is not an object")
    if activations.get("num_bits") != 8:
        raise _refuse(where, group, f"{activations.get('num_bits')}-bit input activations")
    if not activations.get("dynamic", False):
        raise _refuse(where, group, "static input activation scales (input_scale)")
    if activations.get("strategy") != "token":
        raise _refuse(
            where,
            group,
            f"{activations.get('strategy')}-strategy input activations (ditq quantizes per token)",
        )
    if not activations.get("symmetric", True):
        raise _refuse(where, group, "input activation zero points (asymmetric activations)")
    kind = {"int": "int8", "float": "fp8"}.get(str(activations.get("type")))
    if kind is None:
        raise _refuse(where, group, f"{activations.get('type')} input activations")
    return kind  # type: ignore[return-value]


def _preset(
    weight_type: str, activations: ActivationKind | None, where: str, group: str, num_bits: int = 8
) -> Scheme:
    for scheme in SCHEMES.values():
        if (scheme.weight_type, scheme.activations, scheme.num_bits) == (weight_type, activations, num_bits):
            return scheme
    wanted = f"{num_bits}-bit {weight_type} weights with {activations or 'unquantized'} activations"
    raise _refuse(where, group, wanted)


def scheme_in_format(preset: Scheme, fmt: str, group_size: int | None, where: str, group: str) -> Scheme:
    """``preset`` stored in format ``fmt`` (e.g. int8 weight-only stored unpacked as int-quantized)."""
    codec = CODECS.get(fmt)
    if codec is None:
        raise InputError(f"{where}: format {fmt!r} is not one of ditq's formats ({', '.join(CODECS)})")
    if codec.scheme.weight_type != preset.weight_type:
        raise InputError(
            f"{where}: config group {group!r}: {fmt} stores {codec.scheme.weight_type} weights, "
            f"the group's weights are {preset.weight_type}"
        )
    if preset.num_bits != codec.num_bits and not isinstance(codec, PackQuantizedCodec):
        raise _refuse(
            where, group, f"{preset.num_bits}-bit weights in {fmt} (ditq reads them pack-quantized)"
        )
    groups_allowed = preset.activations is None or preset.num_bits == 4
    if group_size is not None and (not groups_allowed or not isinstance(codec, PackQuantizedCodec)):
        raise _refuse(
            where,
            group,
            f"group-wise weight scales in {fmt} (ditq reads them pack-quantized, with 8-bit weights weight-only)",
        )
    return replace(preset.with_group_size(group_size), format=codec.format)  # type: ignore[arg-type]


def config_groups(plain: dict[str, Any], where: str) -> list[ConfigGroup]:
    """Every config group of a plain compressed-tensors config, each read and checked; anything ditq does not
    implement (transforms, 4-bit, zero points, static or non-token activations, ...) is an InputError that
    names the feature, the group and ``where``. ``targets`` and ``ignore`` are lists whose ``re:`` patterns are
    inside the language ``ditq.checkpoint.patterns`` reads."""
    normalize_quant_method(str(plain.get("quant_method", "")))
    if plain.get("transform_config"):
        raise InputError(f"{where}: transform_config is not empty; ditq does not implement transforms")
    check_entries(plain.get("ignore"), f"{where}: ignore")
    groups = plain.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise InputError(f"{where}: quantization_config has no config_groups")
    out = []
    seen: dict[str, Any] = {}
    for name, group in groups.items():
        if not isinstance(group, dict):
            raise InputError(f"{where}: config group {name!r} is not an object")
        twin = next((earlier for earlier, other in seen.items() if other == group), None)
        if twin is not None:  # a conflicting one fails its layers' checks; an identical one is refused here
            raise InputError(f"{where}: config group {name!r} repeats config group {twin!r}: give each once")
        seen[name] = group
        weight_type, group_size, num_bits = _weight_args(group.get("weights"), where, name)
        activations = _activation_kind(group.get("input_activations"), where, name)
        preset = _preset(weight_type, activations, where, name, num_bits)
        fmt = group.get("format") or plain.get("format")
        if fmt is not None and not isinstance(fmt, str):
            raise InputError(f"{where}: config group {name!r}: format {fmt!r} is not a string")
        scheme = (
            None
            if fmt in (None, "mixed-precision")
            else scheme_in_format(preset, fmt, group_size, where, name)
        )
        targets = check_entries(group.get("targets"), f"{where}: config group {name!r}: targets")
        out.append(ConfigGroup(name, targets, weight_type, activations, group_size, scheme, num_bits))
    return out


def scheme_of_config(plain: dict[str, Any], where: str) -> Scheme:
    """The scheme of a plain compressed-tensors config with one group (as ditq writes); else an InputError."""
    groups = config_groups(plain, where)
    if len(groups) != 1 or groups[0].scheme is None:
        raise InputError(f"{where}: quantization_config must have exactly one config group with a format")
    return groups[0].scheme


def layer_scheme(
    group: ConfigGroup, stored: Codec, in_features: int, scale_columns: int, where: str
) -> Scheme:
    """The scheme of one stored Linear: its config group's, cross-checked against what the tensors hold
    (``stored``: the codec the tensor names and dtypes match; ``scale_columns``: weight_scale's columns)."""
    preset = _preset(group.weight_type, group.activations, where, group.name, group.num_bits)
    scheme = group.scheme or scheme_in_format(preset, stored.format, group.group_size, where, group.name)
    if scheme.format != stored.format:
        raise InputError(
            f"{where}: quantization_config says {scheme.format}, but the tensors are {stored.format}"
        )
    stored_group = stored.scheme_for(in_features, scale_columns).group_size
    if stored_group != scheme.group_size:
        said = "per channel" if scheme.group_size is None else f"groups of {scheme.group_size}"
        held = "per channel" if stored_group is None else f"groups of {stored_group}"
        raise InputError(f"{where}: quantization_config says scales {said}, but weight_scale holds {held}")
    return scheme
