"""An artifact's own layers as the doctor's weight cases: one per scheme and distinct geometry.

Works on any compressed-tensors checkpoint in a diffusers directory, ditq's or not: each layer's scheme is
the loader's (``ditq.runtime.loader.stored_layer_schemes``: its config group, cross-checked against its
tensors), and its tensors are read through that scheme's codec (scales in float32, bfloat16 or float16).
A layer stored in another format than its scheme's kernel paths read (int8 weight-only stored
``int-quantized``) is re-encoded for them, as the loader's repack does; its load check then round-trips those
tensors through a file instead of reading the checkpoint's bytes.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ditq.checkpoint.codecs import SCALE, codec_for
from ditq.doctor.cases import Geometry, WeightCase
from ditq.errors import InputError
from ditq.schemes import SCHEMES

__all__ = ["artifact_cases"]


def artifact_cases(artifact: Path) -> dict[str, dict[Geometry, WeightCase]]:
    """scheme -> distinct geometry -> the artifact's first layer of that shape, read with the safetensors
    library (independent of ditq's reader, which the load step then checks against it). Every layer is read and
    its scales checked (``Codec.scale_problem``): a layer whose scales no kernel can use is an InputError naming
    the file and the layer."""
    from safetensors import safe_open

    from ditq.checkpoint.layout import component_names, read_model_index, tensor_files
    from ditq.runtime.loader import is_quantized_component, stored_layer_schemes

    found: dict[str, dict[Geometry, WeightCase]] = {}
    for component in component_names(read_model_index(artifact)):
        if is_quantized_component(artifact, component) is None:
            continue
        files = tensor_files(artifact / component)
        for prefix, scheme in stored_layer_schemes(artifact, component).items():
            codec = codec_for(scheme)
            tensors = {}
            for key in codec.names:
                if f"{prefix}.{key}" not in files:
                    raise InputError(
                        f"{artifact / component}: {prefix}.{key} is missing from the weight files"
                    )
                with safe_open(str(files[f"{prefix}.{key}"]), framework="pt") as handle:
                    tensors[key] = handle.get_tensor(f"{prefix}.{key}")
            try:
                q, scale = codec.read(tensors)
            except InputError as error:
                raise InputError(f"{files[f'{prefix}.{codec.weight_name}']}: {prefix}: {error}") from None
            problem = codec.scale_problem(scale)  # every layer's, not only the one checked per geometry
            if problem is not None:
                raise InputError(f"{files[f'{prefix}.{SCALE}']}: {prefix}: {problem}")
            kernel_codec = codec_for(SCHEMES[scheme.name])
            sources: dict[str, Path] | None = {key: files[f"{prefix}.{key}"] for key in tensors}
            if kernel_codec is not codec:
                tensors, sources = kernel_codec.encode(q, scale), None
            geometry = Geometry(q.shape[1], q.shape[0], group_size=scheme.group_size)
            if geometry in found.setdefault(scheme.name, {}):
                continue
            bias = None
            if f"{prefix}.bias" in files:
                with safe_open(str(files[f"{prefix}.bias"]), framework="pt") as handle:
                    bias = handle.get_tensor(f"{prefix}.bias").to(torch.float32)
            found[scheme.name][geometry] = WeightCase(
                f"artifact:{component}/{prefix}", tensors, bias, sources, prefix
            )
    return found
