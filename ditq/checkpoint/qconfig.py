"""The ``quantization_config`` a quantized component carries (read back by ``codecs.scheme_of_config``).

The dict is built here field by field (not dumped from compressed-tensors'
pydantic models) so that it holds only keys every reader since 0.19 accepts:
no ``scale_dtype``/``zp_dtype``, no null fields. It validates with
``compressed_tensors.quantization.QuantizationConfig`` (tested).
"""

from __future__ import annotations

from typing import Any, Literal

from ditq.errors import InputError
from ditq.schemes import Scheme

__all__ = ["ConfigForm", "quantization_config", "with_quantization_config"]

ConfigForm = Literal["component", "global"]
QUANT_METHOD = "compressed-tensors"


def _weight_args(scheme: Scheme) -> dict[str, Any]:
    args: dict[str, Any] = {
        "num_bits": 8,
        "type": scheme.weight_type,
        "symmetric": True,
        "strategy": scheme.weight_strategy,
        "dynamic": False,
    }
    if scheme.group_size is not None:
        args["group_size"] = scheme.group_size
    return args


def _activation_args(scheme: Scheme) -> dict[str, Any] | None:
    if scheme.activations is None:
        return None
    return {
        "num_bits": 8,
        "type": "int" if scheme.activations == "int8" else "float",
        "symmetric": True,
        "strategy": "token",
        "dynamic": True,
    }


def quantization_config(scheme: Scheme, ignore: list[str]) -> dict[str, Any]:
    """The plain compressed-tensors config: every Linear not in ``ignore`` is quantized with ``scheme``."""
    group: dict[str, Any] = {"targets": ["Linear"], "weights": _weight_args(scheme)}
    activations = _activation_args(scheme)
    if activations is not None:
        group["input_activations"] = activations
    return {
        "quant_method": QUANT_METHOD,
        "format": scheme.format,
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": sorted(ignore),
    }


def with_quantization_config(
    config: dict[str, Any], component: str, plain: dict[str, Any], form: ConfigForm
) -> dict[str, Any]:
    """A copy of a component's config.json carrying ``plain``, wrapped per component or not."""
    if form not in ("component", "global"):
        raise InputError(f"--config-form must be 'component' or 'global', got {form!r}")
    out = dict(config)
    out["quantization_config"] = {component: plain} if form == "component" else plain
    return out
