"""Schemes as data: names and aliases, and the quantization_config every reader accepts."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from compressed_tensors.quantization import QuantizationConfig

from ditq.checkpoint.codecs import scheme_of_config
from ditq.checkpoint.layout import quantization_config_of
from ditq.checkpoint.qconfig import quantization_config, with_quantization_config
from ditq.errors import InputError
from ditq.schemes import (
    CHANNEL,
    FP8,
    SCHEMES,
    W4A8,
    W4A16,
    W8A8,
    W8A16,
    get_scheme,
    normalize_quant_method,
    parse_group_size,
)

ALIASES = {
    "int8wo": "w8a16",
    "int8-weight-only": "w8a16",
    "W8A16": "w8a16",
    "w8a8dyn": "w8a8",
    "int8dq": "w8a8",
    "W8A8": "w8a8",
    "fp8-dynamic": "fp8",
    "FP8": "fp8",
    "int4-weight-only": "w4a16",
    "W4A16": "w4a16",
    "w4afp8": "w4a8",
    "W4A8": "w4a8",
}
ALL_SCHEMES = [W8A16, W8A16.with_group_size(16), W8A8, FP8, W4A16, W4A16.with_group_size(None), W4A8]
# Keys that readers before compressed-tensors 0.20 reject.
FORBIDDEN_KEYS = {"scale_dtype", "zp_dtype"}


@pytest.mark.parametrize(("alias", "name"), sorted(ALIASES.items()))
def test_aliases_normalise(alias: str, name: str) -> None:
    assert get_scheme(alias).name == name


def test_unknown_scheme_suggests_the_closest() -> None:
    with pytest.raises(InputError, match=r"did you mean 'w8a8'"):
        get_scheme("w8a9")


@pytest.mark.parametrize("spelling", ["compressed-tensors", "compressed_tensors", "Compressed_Tensors"])
def test_both_method_spellings_resolve(spelling: str) -> None:
    assert normalize_quant_method(spelling) == "compressed-tensors"


def test_group_size_only_for_weight_only() -> None:
    assert get_scheme("w8a16", group_size=128).group_size == 128
    assert get_scheme("w4a8", group_size=64).group_size == 64
    with pytest.raises(InputError, match="w8a16 and the 4-bit schemes only"):
        get_scheme("w8a8", group_size=128)
    with pytest.raises(InputError, match="positive"):
        get_scheme("w8a16", group_size=0)


def test_group_size_channel_is_one_scale_per_output_channel() -> None:
    """``channel``: the 4-bit schemes' choice of one scale per row instead of groups of 128; what the 8-bit schemes
    are already. Each scheme says which option makes it of its preset (what ``ditq.quantize_`` records)."""
    assert get_scheme("w4a8", CHANNEL) == W4A8.with_group_size(None) != W4A8
    assert get_scheme("int4wo", CHANNEL).weight_strategy == "channel"
    assert [get_scheme(name, CHANNEL) for name in ("w8a16", "w8a8", "fp8")] == [W8A16, W8A8, FP8]
    assert (W4A8.group_size_option, W8A8.group_size_option) == (None, None)
    assert (W4A8.with_group_size(None).group_size_option, W4A8.with_group_size(64).group_size_option) == (
        CHANNEL,
        64,
    )
    assert W8A16.with_group_size(32).group_size_option == 32


@pytest.mark.parametrize(("text", "parsed"), [("channel", CHANNEL), (" Channel ", CHANNEL), ("64", 64)])
def test_parse_group_size(text: str, parsed: object) -> None:
    assert parse_group_size(text) == parsed


@pytest.mark.parametrize("text", ["chanel", "0", "-3", "12x", "1.5", ""])
def test_a_bad_group_size_names_the_flag(text: str) -> None:
    with pytest.raises(
        InputError, match=r"^--group-size .*: a positive number of input features per scale, or "
    ):
        parse_group_size(text)
    with pytest.raises(InputError, match=r"^--group-size "):
        get_scheme("w4a8", text)  # type: ignore[arg-type]  # the API's value, not parsed: refused the same way


def test_formats_and_storage_dtypes() -> None:
    assert (W8A16.format, W8A8.format, FP8.format) == ("pack-quantized", "int-quantized", "float-quantized")
    assert (W8A8.weight_dtype, FP8.weight_dtype) == (torch.int8, torch.float8_e4m3fn)
    assert (W8A16.activations, W8A8.activations, FP8.activations) == (None, "int8", "fp8")


def _keys(value: Any) -> set[str]:
    if isinstance(value, dict):
        return set(value) | {k for v in value.values() for k in _keys(v)}
    return set()


def _values(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [x for v in value.values() for x in _values(v)]
    return [value]


@pytest.mark.parametrize("scheme", ALL_SCHEMES, ids=lambda s: f"{s.name}-g{s.group_size}")
def test_config_validates_with_compressed_tensors(scheme) -> None:  # type: ignore[no-untyped-def]
    plain = quantization_config(scheme, ["proj_out", "img_in"])
    parsed = QuantizationConfig.model_validate(plain)
    group = parsed.config_groups["group_0"]
    assert parsed.format == scheme.format
    assert parsed.ignore == ["img_in", "proj_out"]
    assert group.targets == ["Linear"]
    assert group.weights.num_bits == scheme.num_bits and group.weights.symmetric
    assert group.weights.type == scheme.weight_type
    assert group.weights.strategy == scheme.weight_strategy
    assert group.weights.group_size == scheme.group_size
    if scheme.activations is None:
        assert group.input_activations is None
    else:
        acts = group.input_activations
        assert (acts.strategy, acts.dynamic, acts.symmetric) == ("token", True, True)
    assert not (_keys(plain) & FORBIDDEN_KEYS)
    assert None not in _values(plain)
    assert scheme_of_config(plain, "test") == scheme


@pytest.mark.parametrize("form", ["flat", "wrapped", "global", "component"])
def test_config_forms_read_back(form: str) -> None:
    plain = quantization_config(W8A8, [])
    config = with_quantization_config({"num_layers": 2}, "transformer", plain, form)
    wrapped = config["quantization_config"]
    assert ("transformer" in wrapped) == (form in ("wrapped", "component"))
    assert quantization_config_of(config, "transformer") == plain
    assert config["num_layers"] == 2


def test_scheme_of_config_rejects_other_formats() -> None:
    plain = quantization_config(W8A8, [])
    plain["format"] = "nvfp4-pack-quantized"
    with pytest.raises(InputError, match="'nvfp4-pack-quantized' is not one of ditq's formats"):
        scheme_of_config(plain, "transformer/config.json")


def test_every_scheme_is_listed_once() -> None:
    assert sorted(SCHEMES) == ["fp8", "w4a16", "w4a8", "w8a16", "w8a8"]


def test_four_bit_names() -> None:
    """4-bit schemes by name; ambiguous and calibration names say what to write instead; other widths refused."""
    assert (W4A16.num_bits, W4A16.group_size, W4A8.activations) == (4, 128, "fp8")
    with pytest.raises(InputError, match=r"w4a16 .* or w4a8"):
        get_scheme("int4")
    with pytest.raises(
        InputError, match="calibration, not a format: use --scheme w4a16 or w4a8 with --calibrate gptq"
    ):
        get_scheme("gptq-int4")
    for name in ("nvfp4", "nf4", "w4a4", "int2"):
        with pytest.raises(InputError, match="other formats and widths are not supported"):
            get_scheme(name)


def test_fitted_falls_back_to_per_channel_where_groups_do_not_divide() -> None:
    assert W4A16.fitted(256) == W4A16 and W4A16.fitted(96).group_size is None
    assert W8A16.with_group_size(64).fitted(96).group_size == 64  # 8-bit groups: the layer is kept instead
    assert W4A16.guarded_group_size is None and W8A16.with_group_size(64).guarded_group_size == 64
