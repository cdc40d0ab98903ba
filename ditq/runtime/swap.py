"""Replacing each stored quantized Linear of a meta-built model with its scheme's QuantizedLinear, and a stored
quantized token embedding with a QuantizedEmbedding (``ditq.runtime.embedding``).

A layer's scheme comes from the config group that targets it (``targets``,
``ignore``, ``format``, ``weights``, ``input_activations``), cross-checked
against its stored tensors by the codecs; a disagreement, a stored layer no
group targets, or a targeted Linear with nothing stored is an InputError
naming the layer and the file. A layer that stores a low-rank branch beside its tensors
(``ditq.checkpoint.low_rank``) gets one of that rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ditq.checkpoint.codecs import (
    SCALE,
    SCALE_DTYPES,
    config_groups,
    detect_codec,
    layer_scheme,
    quantized_layers,
    weight_features,
)
from ditq.checkpoint.low_rank import stored_rank
from ditq.checkpoint.patterns import matches
from ditq.checkpoint.safetensors_io import TensorEntry
from ditq.errors import InputError
from ditq.runtime.embedding import QuantizedEmbedding
from ditq.runtime.modules import quantized_linear_class
from ditq.schemes import Scheme

__all__ = ["layer_schemes", "matches", "swap_quantized_linears"]


def layer_schemes(
    model: torch.nn.Module, entries: Mapping[str, TensorEntry], qconfig: dict[str, Any], config_path: str
) -> dict[str, Scheme]:
    """Prefix of every stored quantized Linear (a ``<prefix>.weight_scale`` entry) -> its scheme: the config group
    that targets it, cross-checked against its tensors. The one reading of "which scheme has this layer" that the
    loader, the verifier and the doctor share; ``model`` may be on the meta device and is not changed."""
    groups = config_groups(qconfig, config_path)
    ignore = list(qconfig.get("ignore") or [])
    dtypes = {name: entry.dtype for name, entry in entries.items()}
    schemes: dict[str, Scheme] = {}
    for prefix in quantized_layers(entries):
        scale = entries[f"{prefix}.{SCALE}"]
        where = scale.path
        if scale.dtype not in SCALE_DTYPES:
            names = ", ".join(str(d).removeprefix("torch.") for d in SCALE_DTYPES)
            raise InputError(f"{where}: {prefix}.{SCALE} is {scale.dtype}; scales are {names}")
        try:
            linear = model.get_submodule(prefix)
        except AttributeError:
            raise InputError(f"{where}: {prefix}.{SCALE} names no module of {type(model).__name__}") from None
        features = weight_features(linear)
        if features is None:
            raise InputError(f"{where}: {prefix} is a {type(linear).__name__}, not a Linear or an Embedding")
        codec = detect_codec(prefix, dtypes, str(entries.get(f"{prefix}.weight", scale).path))
        group = next((g for g in groups if matches(list(g.targets), prefix, linear)), None)
        if group is None or matches(ignore, prefix, linear):
            why = "is listed in ignore" if group is not None else "is targeted by no config group"
            raise InputError(f"{config_path}: {prefix} is stored quantized but {why}")
        if isinstance(linear, torch.nn.Embedding) and group.activations is not None:
            raise InputError(
                f"{config_path}: {prefix} is an Embedding, and config group {group.name!r} quantizes "
                f"{group.activations} input activations; an embedding's lookup has none (weight-only groups)"
            )
        columns = scale.shape[1] if len(scale.shape) == 2 else 1
        schemes[prefix] = layer_scheme(group, codec, features[1], columns, f"{config_path}: {prefix}")
    return schemes


def swap_quantized_linears(
    model: torch.nn.Module,
    entries: dict[str, TensorEntry],
    qconfig: dict[str, Any],
    component_dir: Path,
    dtype: torch.dtype,
) -> dict[str, Scheme]:
    """Swap every stored quantized Linear (a ``<prefix>.weight_scale`` entry) in place for its scheme's class, with
    the low-rank branch its entries hold; returns prefix -> scheme (``layer_schemes``)."""
    schemes = layer_schemes(model, entries, qconfig, f"{component_dir}/config.json")
    for prefix, scheme in schemes.items():
        linear = model.get_submodule(prefix)
        parent_name, _, attr = prefix.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if isinstance(
            linear, torch.nn.Embedding
        ):  # a token embedding (the 4-bit schemes' ``Scheme.embedding``)
            rows = QuantizedEmbedding(
                linear.num_embeddings, linear.embedding_dim, scheme, linear.padding_idx, "meta", dtype
            )
            setattr(parent, attr, rows)
            continue
        assert isinstance(linear, torch.nn.Linear)  # layer_schemes checked it
        replacement = quantized_linear_class(scheme.name)(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            group_size=scheme.group_size,
            device="meta",
            bias_dtype=dtype,
            scheme=scheme,
            low_rank=stored_rank(prefix, entries, linear.out_features, linear.in_features),
        )
        setattr(parent, attr, replacement)
    targets = [t for g in config_groups(qconfig, f"{component_dir}/config.json") for t in g.targets]
    ignore = list(qconfig.get("ignore") or [])
    for name, module in model.named_modules():
        if (
            isinstance(module, torch.nn.Linear)
            and matches(targets, name, module)
            and not matches(ignore, name, module)
        ):
            raise InputError(
                f"{component_dir}: {name} is targeted by quantization_config and not ignored, "
                f"but the weight files hold no {name}.{SCALE} (incomplete artifact)"
            )
    return schemes
