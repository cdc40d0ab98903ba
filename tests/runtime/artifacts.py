"""Writing ditq artifacts straight from a model's tensors (no quantizer): seeded, in the stored conventions.

``write_artifact`` quantizes a real model's block Linears with ditq.numerics;
``write_random_artifact`` draws stored tensors for a model built on the meta
device, so a large artifact costs no full-precision model in memory.
Target rule (the one the quantizer applies): Linears inside repeated blocks
(a ModuleList index in the name) with both dimensions multiples of 16;
everything else is listed in ``ignore``.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ditq.checkpoint.codecs import codec_for
from ditq.numerics import quantize_weight
from ditq.schemes import Scheme, get_scheme

__all__ = [
    "quantization_config",
    "target_linears",
    "write_artifact",
    "write_large_qwen_artifact",
    "write_random_artifact",
]

_BLOCK = re.compile(r"blocks\.\d+\.")
_BOUNDARY = re.compile(r"(^|\.)(norm\w*|\w*mod\w*|adaLN\w*)(\.|$)")


def target_linears(model: torch.nn.Module) -> list[str]:
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
        and _BLOCK.search(name)
        and not _BOUNDARY.search(name)
        and module.in_features % 16 == 0
        and module.out_features % 16 == 0
    ]


def quantization_config(scheme: Scheme, ignore: list[str], component: str, form: str) -> dict[str, Any]:
    weights = {
        "num_bits": 8,
        "type": scheme.weight_type,
        "symmetric": True,
        "strategy": scheme.weight_strategy,
        "group_size": scheme.group_size,
        "dynamic": False,
    }
    group: dict[str, Any] = {"targets": ["Linear"], "weights": weights, "format": scheme.format}
    if scheme.activations is not None:
        group["input_activations"] = {
            "num_bits": 8,
            "type": "int" if scheme.activations == "int8" else "float",
            "symmetric": True,
            "strategy": "token",
            "dynamic": True,
        }
    plain = {
        "quant_method": "compressed-tensors",
        "format": scheme.format,
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": sorted(ignore),
    }
    return plain if form == "flat" else {component: plain}


def _copy_siblings(source_dir: Path, out_dir: Path, component: str) -> None:
    """Every entry of ``source_dir`` but ``component`` and the manifest's files: they would describe another
    artifact (the loader refuses an artifact holding what its manifest does not list)."""
    out_dir.mkdir(parents=True)
    for item in source_dir.iterdir():
        if (
            item.name == component
            or item.name.startswith("MANIFEST.json")
            or item.name == "tensor_errors.json"
        ):
            continue
        if item.is_dir():
            shutil.copytree(item, out_dir / item.name)
        else:
            shutil.copy2(item, out_dir / item.name)


def _write(
    out_dir: Path,
    component: str,
    config: dict[str, Any],
    tensors: Iterator[tuple[str, torch.Tensor]],
    shard_bytes: int,
) -> None:
    folder = out_dir / component
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shard: dict[str, torch.Tensor] = {}
    shards: list[list[str]] = []
    size = 0

    def flush() -> None:
        nonlocal shard, size
        if shard:
            shards.append(list(shard))
            save_file(shard, str(folder / f"part-{len(shards):05d}.safetensors"), metadata={"format": "pt"})
        shard, size = {}, 0

    for name, tensor in tensors:
        shard[name] = tensor.contiguous()
        size += tensor.numel() * tensor.element_size()
        if size >= shard_bytes:
            flush()
    flush()
    count = len(shards)
    weight_map = {}
    for index, names in enumerate(shards, start=1):
        final = f"diffusion_pytorch_model-{index:05d}-of-{count:05d}.safetensors"
        (folder / f"part-{index:05d}.safetensors").rename(folder / final)
        weight_map.update(dict.fromkeys(names, final))
    index_doc = {"metadata": {}, "weight_map": weight_map}
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps(index_doc, indent=2) + "\n"
    )


def write_artifact(
    source_dir: Path,
    out_dir: Path,
    model: torch.nn.Module,
    scheme_name: str,
    form: str = "flat",
    component: str = "transformer",
    shard_bytes: int = 1 << 40,
) -> Path:
    """Quantize ``model`` (the one saved in ``source_dir``) into an artifact at ``out_dir``."""
    scheme = get_scheme(scheme_name)
    targets = set(target_linears(model))
    ignore = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n not in targets]
    config = json.loads((source_dir / component / "config.json").read_text())
    config["quantization_config"] = quantization_config(scheme, ignore, component, form)
    _copy_siblings(source_dir, out_dir, component)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in model.state_dict().items():
            prefix, _, attr = name.rpartition(".")
            if prefix in targets and attr == "weight":
                q, scale = quantize_weight(tensor, scheme)
                for key, value in codec_for(scheme).encode(q, scale).items():
                    yield f"{prefix}.{key}", value
            else:
                yield name, tensor

    _write(out_dir, component, config, tensors(), shard_bytes)
    return out_dir


def write_random_artifact(
    out_dir: Path,
    build_on_meta: Callable[[], torch.nn.Module],
    config: dict[str, Any],
    scheme_name: str,
    siblings_from: Path | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    shard_bytes: int = 256 << 20,
) -> Path:
    """An artifact whose ``transformer`` holds random stored tensors for a model built on meta.

    The other components (and model_index.json) are copied from ``siblings_from``; without it the
    artifact holds the transformer alone.
    """
    scheme = get_scheme(scheme_name)
    model = build_on_meta()
    targets = set(target_linears(model))
    ignore = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n not in targets]
    class_name = type(model).__name__
    if siblings_from is not None:
        _copy_siblings(siblings_from, out_dir, "transformer")
    else:
        out_dir.mkdir(parents=True)
        index = {"_class_name": "DiffusionPipeline", "transformer": ["diffusers", class_name]}
        (out_dir / "model_index.json").write_text(json.dumps(index) + "\n")
    quantization = quantization_config(scheme, ignore, "transformer", "flat")
    config = {**config, "_class_name": class_name, "quantization_config": quantization}
    generator = torch.Generator().manual_seed(seed)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name, placeholder in model.state_dict().items():
            prefix, _, attr = name.rpartition(".")
            shape = tuple(placeholder.shape)
            if prefix in targets and attr == "weight":
                q = torch.randint(-127, 128, shape, dtype=torch.int8, generator=generator)
                if scheme.weight_type == "float":
                    q = (q.to(torch.float32) * 3.5).to(torch.float8_e4m3fn)
                scale = torch.full((shape[0], 1), 0.02 / 127, dtype=torch.float32)
                for key, value in codec_for(scheme).encode(q, scale).items():
                    yield f"{prefix}.{key}", value
            elif placeholder.is_floating_point():
                yield name, (torch.randn(shape, generator=generator) * 0.02).to(dtype)
            else:
                yield name, torch.zeros(shape, dtype=placeholder.dtype)

    _write(out_dir, "transformer", config, tensors(), shard_bytes)
    return out_dir


def write_large_qwen_artifact(out_dir: Path, num_layers: int, siblings_from: Path) -> Path:
    """A w8a8 Qwen-Image-2.1 artifact of ``num_layers`` full-width blocks (16 heads of 64) holding random tensors,
    the other components copied from ``siblings_from``: about 17 MiB a block, large enough that an interpreter's
    own memory noise does not matter to a measurement of its loading."""
    from diffusers import QwenImage21Transformer2DModel

    config: dict[str, Any] = dict(
        num_layers=num_layers,
        num_attention_heads=16,
        attention_head_dim=64,
        context_in_dim=1024,
        in_channels=64,
        out_channels=64,
        axes_dims_rope=(16, 24, 24),
    )

    def on_meta() -> torch.nn.Module:
        with torch.device("meta"):
            return QwenImage21Transformer2DModel(**config)

    return write_random_artifact(out_dir, on_meta, config, "w8a8", siblings_from=siblings_from)
