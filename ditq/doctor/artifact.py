"""An artifact's own layers as the doctor's weight cases: one per scheme and distinct geometry."""

from __future__ import annotations

from pathlib import Path

import torch

from ditq.checkpoint.codecs import SCALE, detect_codec, quantized_layers
from ditq.doctor.cases import Geometry, WeightCase

__all__ = ["artifact_cases"]


def artifact_cases(artifact: Path) -> dict[str, dict[Geometry, WeightCase]]:
    """scheme -> distinct geometry -> the artifact's first layer of that shape, read with the safetensors
    library (independent of ditq's reader, which the load step then checks against it)."""
    from safetensors import safe_open

    from ditq.checkpoint.layout import (
        component_names,
        load_component_config,
        quantization_config_of,
        read_model_index,
        tensor_files,
    )

    found: dict[str, dict[Geometry, WeightCase]] = {}
    for component in component_names(read_model_index(artifact)):
        component_dir = artifact / component
        if not (component_dir / "config.json").is_file():
            continue
        if quantization_config_of(load_component_config(component_dir), component) is None:
            continue
        files = tensor_files(component_dir)
        for prefix, names in quantized_layers(files).items():
            tensors = {}
            for key in names:
                with safe_open(str(files[f"{prefix}.{key}"]), framework="pt") as handle:
                    tensors[key] = handle.get_tensor(f"{prefix}.{key}")
            dtypes = {f"{prefix}.{key}": t.dtype for key, t in tensors.items()}
            codec = detect_codec(prefix, dtypes, str(files[f"{prefix}.{SCALE}"]))
            stored = {key: tensors[key] for key in codec.names if key in tensors}
            q, scale = codec.read(stored)
            scheme_name = codec.scheme.name
            groups = scale.shape[1]
            geometry = Geometry(
                q.shape[1], q.shape[0], group_size=None if groups == 1 else q.shape[1] // groups
            )
            if geometry in found.setdefault(scheme_name, {}):
                continue
            bias = None
            if f"{prefix}.bias" in files:
                with safe_open(str(files[f"{prefix}.bias"]), framework="pt") as handle:
                    bias = handle.get_tensor(f"{prefix}.bias").to(torch.float32)
            sources = {key: files[f"{prefix}.{key}"] for key in stored}
            found[scheme_name][geometry] = WeightCase(
                f"artifact:{component}/{prefix}", stored, bias, sources, prefix
            )
    return found
