"""The codecs: each format's stored layout (written out here from compressed-tensors' conventions), encode ->
read -> decode round trips checked against compressed-tensors' own decoder, one-line errors naming the tensor,
and recognising a scheme from a checkpoint's tensors or its quantization_config."""

from __future__ import annotations

import pytest
import torch

from ditq.checkpoint.codecs import (
    CODECS,
    codec_for,
    config_groups,
    detect_codec,
    is_quantized_tensor,
    layer_scheme,
    quantized_layers,
    scheme_of_config,
)
from ditq.checkpoint.qconfig import quantization_config
from ditq.checkpoint.reference import ReferenceDecoder
from ditq.errors import InputError
from ditq.numerics import dequantize_weight, quantize_weight
from ditq.schemes import FP8, W4A8, W4A16, W8A8, W8A16, Scheme

SCHEMES = [
    W8A16,
    W8A16.with_group_size(32),
    W8A8,
    FP8,
    W4A16.with_group_size(None),
    W4A16.with_group_size(32),
    W4A8.with_group_size(32),
]
I32, I64, F32 = torch.int32, torch.int64, torch.float32
# (out, in) = (48, 128): the tensors per quantized Linear, in file order (DESIGN.md's table).
LAYOUTS = {
    "w8a16": {"weight_packed": (I32, (48, 32)), "weight_scale": (F32, (48, 1)), "weight_shape": (I64, (2,))},
    "w8a16-g32": {
        "weight_packed": (I32, (48, 32)),
        "weight_scale": (F32, (48, 4)),
        "weight_shape": (I64, (2,)),
    },
    "w8a8": {"weight": (torch.int8, (48, 128)), "weight_scale": (F32, (48, 1))},
    "fp8": {"weight": (torch.float8_e4m3fn, (48, 128)), "weight_scale": (F32, (48, 1))},
    # 4 bits: eight values to an int32
    "w4a16": {"weight_packed": (I32, (48, 16)), "weight_scale": (F32, (48, 1)), "weight_shape": (I64, (2,))},
    "w4a16-g32": {
        "weight_packed": (I32, (48, 16)),
        "weight_scale": (F32, (48, 4)),
        "weight_shape": (I64, (2,)),
    },
    "w4a8-g32": {
        "weight_packed": (I32, (48, 16)),
        "weight_scale": (F32, (48, 4)),
        "weight_shape": (I64, (2,)),
    },
}


def _id(scheme: Scheme) -> str:
    return scheme.name + (f"-g{scheme.group_size}" if scheme.group_size else "")


def _stored(scheme: Scheme, out_features: int = 48, in_features: int = 128) -> dict[str, torch.Tensor]:
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(0)) * 0.02
    return codec_for(scheme).encode(*quantize_weight(weight, scheme))


@pytest.mark.parametrize("scheme", SCHEMES, ids=_id)
def test_layout_encode_read_decode(scheme: Scheme) -> None:
    codec = codec_for(scheme)
    assert codec.specs(48, 128, scheme.group_size) == LAYOUTS[_id(scheme)]
    stored = _stored(scheme)
    assert list(stored) == list(LAYOUTS[_id(scheme)])  # file order
    assert {k: (v.dtype, tuple(v.shape)) for k, v in stored.items()} == LAYOUTS[_id(scheme)]
    assert codec.features(stored) == (48, 128)
    q, scale = codec.read(stored)
    weight = torch.randn(48, 128, generator=torch.Generator().manual_seed(0)) * 0.02
    expected_q, expected_scale = quantize_weight(weight, scheme)
    assert torch.equal(q.view(torch.uint8), expected_q.view(torch.uint8)) and torch.equal(
        scale, expected_scale
    )
    decoded = codec.decode(stored)
    assert torch.equal(decoded, dequantize_weight(expected_q, expected_scale))
    theirs = ReferenceDecoder(quantization_config(scheme, [])).decode(stored)
    assert decoded.dtype == theirs.dtype and torch.equal(decoded, theirs)
    # w4a8's tensors are w4a16's: only its config's input_activations tell them apart
    stored_as = W4A16.with_group_size(scheme.group_size) if scheme.name == "w4a8" else scheme
    assert codec.scheme_for(128, scale.shape[1]) == stored_as


def test_packed_width_is_compressed_tensors_ceiling() -> None:
    """compressed-tensors packs ceil(in * bits / 32) int32 words per row."""
    assert codec_for(W8A16).specs(4, 36)["weight_packed"] == (I32, (4, 9))
    assert codec_for(W8A16).specs(4, 37)["weight_packed"] == (I32, (4, 10))
    assert codec_for(W4A16).specs(4, 40)["weight_packed"] == (I32, (4, 5))
    assert codec_for(W4A16).specs(4, 41)["weight_packed"] == (I32, (4, 6))


def test_four_bit_weights_read_with_the_eight_bit_codec_name_the_width() -> None:
    """A 4-bit layer's packed words are half as many: read as 8-bit, the shape check says so in one line."""
    stored = _stored(W4A16.with_group_size(32))
    with pytest.raises(
        InputError, match=r"'weight_packed' is torch\.int32 \(48, 16\), expected torch\.int32 \(48, 32\)"
    ):
        codec_for(W8A16).read(stored)


def test_four_bit_config_groups_read_back() -> None:
    for scheme in (W4A16, W4A8, W4A16.with_group_size(None)):
        config = quantization_config(scheme, [])
        assert config["config_groups"]["group_0"]["weights"]["num_bits"] == 4
        assert scheme_of_config(config, "config.json") == scheme


def test_four_bit_float_weights_are_refused() -> None:
    config = quantization_config(W4A16, [])
    config["config_groups"]["group_0"]["weights"]["type"] = "float"
    with pytest.raises(InputError, match="4-bit float weights"):
        config_groups(config, "config.json")


BROKEN = {
    "missing": (W8A8, lambda s: s.pop("weight_scale"), r"lacks 'weight_scale'"),
    "dtype": (W8A8, lambda s: s.update(weight=s["weight"].to(torch.int16)), r"'weight' is torch\.int16"),
    "fp8 as int8": (FP8, lambda s: s.update(weight=s["weight"].view(torch.int8)), r"'weight' is torch\.int8"),
    "packed width": (
        W8A16,
        lambda s: s.update(weight_packed=s["weight_packed"][:, :-1]),
        r"'weight_packed' is",
    ),
    "shape values": (W8A16, lambda s: s.update(weight_shape=torch.tensor([48, 64])), r"'weight_packed' is"),
    "scale rows": (
        W8A8,
        lambda s: s.update(weight_scale=s["weight_scale"][:-1]),
        r"'weight_scale' .* not fit",
    ),
    "grouped int8": (
        W8A8,
        lambda s: s.update(weight_scale=torch.ones(48, 4)),
        r"'weight_scale' is .*\(48, 1\)",
    ),
    "scale dtype": (
        FP8,
        lambda s: s.update(weight_scale=s["weight_scale"].double()),  # float32, bfloat16, float16 are read
        r"'weight_scale' is torch\.f",
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_read_names_the_tensor(case: str) -> None:
    scheme, edit, message = BROKEN[case]
    stored = _stored(scheme)
    edit(stored)
    with pytest.raises(InputError, match=message) as info:
        codec_for(scheme).read(stored)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("scheme", SCHEMES, ids=_id)
def test_detected_from_names_and_dtypes(scheme: Scheme) -> None:
    names = {f"blocks.0.to_q.{k}": v.dtype for k, v in _stored(scheme).items()} | {"blocks.0.to_q.bias": F32}
    # the format's codec: a packed layer's width is its config's num_bits (the names and dtypes are alike)
    assert detect_codec("blocks.0.to_q", names, "file") is CODECS[scheme.format]
    assert quantized_layers(names) == {"blocks.0.to_q": sorted(_stored(scheme))}
    assert all(is_quantized_tensor(n, dtype) for n, dtype in names.items() if not n.endswith("bias"))


def test_undetectable_layer_names_file_and_tensor() -> None:
    names = {"a.weight": torch.int16, "a.weight_scale": F32}
    with pytest.raises(InputError, match=r"^f\.safetensors: a\.weight_scale has no int8/fp8 weight .*int16"):
        detect_codec("a", names, "f.safetensors")


def test_source_tensors_are_not_quantized() -> None:
    assert not is_quantized_tensor("blocks.0.to_q.weight", torch.bfloat16)
    assert not is_quantized_tensor("blocks.0.norm.weight", F32)
    assert is_quantized_tensor("blocks.0.to_q.input_scale", F32)


@pytest.mark.parametrize("scheme", SCHEMES, ids=_id)
def test_scheme_of_config_reads_back_what_is_written(scheme: Scheme) -> None:
    plain = quantization_config(scheme, ["proj_out"])
    assert scheme_of_config(plain, "config.json") == scheme


def test_weight_only_int8_stored_unpacked_is_weight_only() -> None:
    plain = quantization_config(W8A8, [])
    del plain["config_groups"]["group_0"]["input_activations"]
    (group,) = config_groups(plain, "config.json")
    assert group.scheme is not None
    assert (group.scheme.name, group.scheme.format, group.scheme.activations) == (
        "w8a16",
        "int-quantized",
        None,
    )
    assert codec_for(group.scheme) is codec_for(W8A8)  # stored as int-quantized: weight int8 (out, in)


def test_a_mixed_precision_group_takes_its_format_from_the_tensors() -> None:
    plain = quantization_config(W8A16, [])
    plain["format"] = "mixed-precision"
    (group,) = config_groups(plain, "config.json")
    assert group.scheme is None
    scheme = layer_scheme(group, codec_for(W8A16), 128, 1, "config.json: blocks.0.to_q")
    assert scheme == W8A16
    with pytest.raises(
        InputError, match=r"blocks\.0\.to_q: quantization_config says scales per channel, but"
    ):
        layer_scheme(group, codec_for(W8A16), 128, 4, "config.json: blocks.0.to_q")


def test_a_format_the_tensors_contradict_is_named() -> None:
    (group,) = config_groups(quantization_config(FP8, []), "config.json")
    with pytest.raises(
        InputError,
        match=r"^config\.json: a: quantization_config says float-quantized, but the tensors are int-quantized$",
    ):
        layer_scheme(group, codec_for(W8A8), 128, 1, "config.json: a")


def _set(path: str, value: object):  # type: ignore[no-untyped-def]
    def edit(plain: dict) -> None:  # type: ignore[type-arg]
        *parents, key = path.split("/")
        node = plain
        for part in parents:
            node = node[part]
        node[key] = value

    return edit


# (edit of a W8A8 config, the feature the one-line refusal names). Each is something compressed-tensors can
# describe and ditq does not implement.
UNSUPPORTED = {
    "transform": (
        _set("transform_config", {"config_groups": {"r": {"type": "hadamard"}}}),
        "transform_config",
    ),
    "4-bit": (_set("config_groups/group_0/weights/num_bits", 4), "4-bit int weights with int8 activations"),
    "2-bit": (_set("config_groups/group_0/weights/num_bits", 2), "2-bit int weights"),
    "zero points": (_set("config_groups/group_0/weights/symmetric", False), "weight zero points"),
    "per-tensor": (_set("config_groups/group_0/weights/strategy", "tensor"), "tensor-strategy weight scales"),
    "static input": (
        _set("config_groups/group_0/input_activations/dynamic", False),
        "static input activation",
    ),
    "group activations": (
        _set("config_groups/group_0/input_activations/strategy", "group"),
        "group-strategy input",
    ),
    "fp8 weight-only": (
        lambda plain: (
            plain["config_groups"]["group_0"]["weights"].update(type="float"),
            plain["config_groups"]["group_0"].pop("input_activations"),
            plain.update(format="float-quantized"),
        ),
        "float weights with unquantized activations",
    ),
}


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_what_ditq_does_not_implement_is_refused_by_name(case: str) -> None:
    edit, feature = UNSUPPORTED[case]
    plain = quantization_config(W8A8, [])
    edit(plain)
    with pytest.raises(InputError, match=f"^transformer/config\\.json: .*{feature}") as error:
        config_groups(plain, "transformer/config.json")
    assert "\n" not in str(error.value)
