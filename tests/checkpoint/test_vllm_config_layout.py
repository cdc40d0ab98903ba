"""The quantization_config of each scheme, as ditq writes it, has the field layout vLLM's compressed-tensors
parser reads, and vLLM would pick the intended scheme for its Linears.

The oracle is written out here from vLLM's ``CompressedTensorsConfig`` (``from_config``,
``_quantization_scheme_map_from_config``, ``_is_dynamic_token_w8a8``, ``_is_fp8_w8a8``,
``_is_wNa16_group_channel``, ``_get_scheme_from_parts``): the flat form (``quant_method`` at the top), the
top-level ``format``, each group's ``targets``, its ``weights`` and ``input_activations`` as compressed-tensors'
``QuantizationArgs``. llm-compressor's own checkpoints (tests/data/llmc) go through the same oracle.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from compressed_tensors.quantization import QuantizationArgs
from tiny_models import LLMC_DATA, LLMC_SCHEMES

import ditq

ACTIVATION_FORMATS = {
    "naive-quantized",
    "int-quantized",
    "float-quantized",
}  # is_activation_quantization_format
WNA16_BITS = {4, 8}  # WNA16_SUPPORTED_BITS
EXPECTED = {
    "w8a8": "CompressedTensorsW8A8Int8",
    "fp8": "CompressedTensorsW8A8Fp8",
    "w8a16": "CompressedTensorsWNA16",
}


def vllm_scheme(quantization_config: dict[str, Any]) -> str:
    """The scheme class vLLM's parser chooses for a Linear targeted by the config's group, or why none."""
    if quantization_config.get("quant_method") != "compressed-tensors":
        return "unquantized (no quant_method at the top of quantization_config)"
    quant_format = quantization_config.get("format")
    (group,) = quantization_config["config_groups"].values()
    assert group["targets"], "vLLM maps a group's scheme to each of its targets"
    weights = QuantizationArgs.model_validate(group["weights"])
    inputs = None
    if quant_format in ACTIVATION_FORMATS and group.get("input_activations"):
        inputs = QuantizationArgs.model_validate(group["input_activations"])
    static_weights = weights.symmetric and not weights.dynamic
    weight_only = inputs is None and weights.strategy in ("channel", "group") and static_weights
    if weight_only and quant_format == "pack-quantized" and weights.num_bits in WNA16_BITS:
        return "CompressedTensorsWNA16"
    if quant_format in ACTIVATION_FORMATS and inputs is not None:
        per_channel = weights.strategy in ("tensor", "channel")
        if weights.type == inputs.type == "float" and static_weights and per_channel and inputs.dynamic:
            return "CompressedTensorsW8A8Fp8"
        dynamic_token = inputs.dynamic and inputs.strategy == "token" and not weights.dynamic
        if weights.num_bits == inputs.num_bits == 8 and per_channel and weights.symmetric and dynamic_token:
            return "CompressedTensorsW8A8Int8"
    return "no compressed-tensors compatible scheme"


def _config(component_dir: Path) -> dict[str, Any]:
    return json.loads((component_dir / "config.json").read_text())["quantization_config"]


@pytest.mark.parametrize("scheme", sorted(EXPECTED))
def test_ditq_configs_read_as_vllm_reads_them(scheme: str, model_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / scheme
    ditq.quantize(model_dir("flux"), out, scheme)
    config = _config(out / "transformer")
    (group,) = config["config_groups"].values()
    assert (
        config["format"]
        == {"w8a8": "int-quantized", "fp8": "float-quantized", "w8a16": "pack-quantized"}[scheme]
    )
    activations = group.get("input_activations")
    assert (activations is None) == (scheme == "w8a16")
    if activations is not None:
        assert activations["dynamic"] is True and activations["strategy"] == "token"
    assert vllm_scheme(config) == EXPECTED[scheme]

    wrapped = tmp_path / f"{scheme}-wrapped"
    ditq.quantize(model_dir("flux"), wrapped, scheme, config_form="wrapped")
    assert vllm_scheme(_config(wrapped / "transformer")).startswith("unquantized")  # why flat is the default


@pytest.mark.parametrize("fixture", sorted(LLMC_SCHEMES))
def test_llm_compressor_configs_read_the_same(fixture: str) -> None:
    assert vllm_scheme(_config(LLMC_DATA / fixture / "transformer")) == EXPECTED[LLMC_SCHEMES[fixture]]
