"""The ``quantization_config`` a quantized component carries (read back by ``codecs.config_groups``).

Each component has its own ``config.json``, so the flat compressed-tensors form there already applies to one
component: that is the default (``flat``), the form compressed-tensors, transformers and vLLM's parser read. The
per-component wrapper (``{"transformer": {...}}``, ``wrapped``) is written only on request, for servers that
expect it; ditq reads both. ``component`` and ``global``, the names of the two forms before the flat one became
the default, still select ``wrapped`` and ``flat``.

The dict is built here field by field (not dumped from compressed-tensors'
pydantic models) so that it holds only keys every reader since 0.19 accepts:
no ``scale_dtype``/``zp_dtype``, no null fields. It validates with
``compressed_tensors.quantization.QuantizationConfig`` (tested).

One scheme: one group targeting ``Linear``, the format at the top. Several (a plan's mixed precision): one
group per scheme targeting its layers by name, each group with its own ``format``, and at the top the format
they share or ``mixed-precision`` where they differ -- what compressed-tensors itself writes
(``QuantizationConfig.from_pretrained`` and ``merge``: ``mixed_precision`` when the groups' formats differ;
``QuantizationScheme.format`` per group, which is what its decompressors read).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from ditq.errors import InputError
from ditq.schemes import SCHEMES, Scheme

__all__ = [
    "CONFIG_FORMS",
    "MIXED_PRECISION",
    "ConfigForm",
    "mixed_quantization_config",
    "quantization_config",
    "resolve_config_form",
    "with_quantization_config",
]

ConfigForm = Literal["flat", "wrapped"]
CONFIG_FORMS: tuple[ConfigForm, ...] = ("flat", "wrapped")
_FORM_ALIASES: dict[str, ConfigForm] = {
    "flat": "flat",
    "global": "flat",
    "wrapped": "wrapped",
    "component": "wrapped",
}
QUANT_METHOD = "compressed-tensors"
MIXED_PRECISION = "mixed-precision"  # compressed-tensors' top-level format when the groups' formats differ


def resolve_config_form(name: str) -> ConfigForm:
    """``flat`` or ``wrapped`` (``global`` and ``component`` are their former names)."""
    if name not in _FORM_ALIASES:
        raise InputError(f"--config-form must be one of {', '.join(CONFIG_FORMS)}, got {name!r}")
    return _FORM_ALIASES[name]


def _weight_args(scheme: Scheme) -> dict[str, Any]:
    args: dict[str, Any] = {
        "num_bits": scheme.num_bits,
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


def _group(scheme: Scheme, targets: list[str]) -> dict[str, Any]:
    group: dict[str, Any] = {"targets": targets, "weights": _weight_args(scheme)}
    activations = _activation_args(scheme)
    if activations is not None:
        group["input_activations"] = activations
    return group


def _config(fmt: str, groups: list[dict[str, Any]], ignore: list[str]) -> dict[str, Any]:
    return {
        "quant_method": QUANT_METHOD,
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {f"group_{i}": group for i, group in enumerate(groups)},
        "ignore": sorted(ignore),
    }


def quantization_config(scheme: Scheme, ignore: list[str]) -> dict[str, Any]:
    """The plain compressed-tensors config: every Linear not in ``ignore`` is quantized with ``scheme``."""
    return _config(scheme.format, [_group(scheme, ["Linear"])], ignore)


def mixed_quantization_config(layers: Mapping[str, Scheme], ignore: list[str]) -> dict[str, Any]:
    """The plain config of a component whose Linears have several schemes (``layers``: name -> scheme): one group
    per scheme present, in the order of ``SCHEMES``, targeting its layers by exact name and naming its format;
    the top-level format is theirs where they share one, else ``mixed-precision``."""
    by_scheme: dict[Scheme, list[str]] = {}
    for name, scheme in sorted(layers.items()):
        by_scheme.setdefault(scheme, []).append(name)
    order = list(SCHEMES)
    schemes = sorted(by_scheme, key=lambda s: (order.index(s.name), s.group_size or 0))
    groups = [{**_group(s, by_scheme[s]), "format": s.format} for s in schemes]
    formats = {s.format for s in schemes}
    return _config(formats.pop() if len(formats) == 1 else MIXED_PRECISION, groups, ignore)


def with_quantization_config(
    config: dict[str, Any], component: str, plain: dict[str, Any], form: str = "flat"
) -> dict[str, Any]:
    """A copy of a component's config.json carrying ``plain``, flat or wrapped per component."""
    out = dict(config)
    out["quantization_config"] = plain if resolve_config_form(form) == "flat" else {component: plain}
    return out
