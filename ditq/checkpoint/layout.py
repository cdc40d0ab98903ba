"""Reading a diffusers model directory: model_index.json, component folders, weight files, configs.

A diffusers directory (the layout of a hub snapshot) holds ``model_index.json``
naming each component as ``[library, class]``, and one folder per component
with ``config.json`` and either one ``*.safetensors`` file or shards with a
``*.safetensors.index.json`` whose ``weight_map`` names each tensor's shard.
"""

from __future__ import annotations

import os
import re
from pathlib import Path, PurePosixPath
from typing import Any

from ditq.errors import InputError
from ditq.jsonfile import read_json_object
from ditq.schemes import normalize_quant_method

__all__ = [
    "MODEL_INDEX",
    "check_components_present",
    "component_class",
    "component_names",
    "is_weight_file",
    "load_component_config",
    "quantization_config_of",
    "read_json",
    "read_model_index",
    "tensor_files",
    "variant_of",
    "weight_files",
]

MODEL_INDEX = "model_index.json"


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path`` (``ditq.jsonfile``: bounded; a missing or malformed file is an InputError
    naming it)."""
    return read_json_object(path)


def read_model_index(model_dir: Path) -> dict[str, Any]:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise InputError(f"{model_dir}: {'not a directory' if model_dir.exists() else 'no such directory'}")
    if not (model_dir / MODEL_INDEX).is_file():
        raise InputError(f"{model_dir}: not a diffusers model directory (no {MODEL_INDEX})")
    index = read_json(model_dir / MODEL_INDEX)
    for name, value in index.items():
        _check_entry(model_dir / MODEL_INDEX, name, value)
    if not component_names(index):
        raise InputError(
            f'{model_dir / MODEL_INDEX}: names no component (each is an entry "name": [library, class])'
        )
    return index


def _check_entry(path: Path, name: str, value: Any) -> None:
    """A component entry (a list of strings or nulls) is ``[library, class]`` under a plain name: one folder of
    the model directory, never a path. Other keys are the pipeline's own settings."""
    if (
        name.startswith("_")
        or not isinstance(value, list)
        or not all(v is None or isinstance(v, str) for v in value)
    ):
        return
    if not name.isidentifier():
        raise InputError(
            f"{path}: component name {name!r} is not a plain name (a folder of the model directory)"
        )
    if len(value) != 2 or (value[0] is None) != (value[1] is None):
        raise InputError(f"{path}: {name}: {value} is not [library, class]")


def component_names(model_index: dict[str, Any]) -> list[str]:
    """Components declared as [library, class] pairs (not null, not private keys)."""
    return [
        name
        for name, value in model_index.items()
        if not name.startswith("_") and isinstance(value, list) and len(value) == 2 and value[0] is not None
    ]


def check_components_present(model_dir: Path, model_index: dict[str, Any]) -> None:
    """Every component ``model_index.json`` declares has its folder; the first one missing is an InputError."""
    model_dir = Path(model_dir)
    for name in component_names(model_index):
        folder = model_dir / name
        if folder.is_symlink() and not folder.exists():  # an artifact moved away from the source it links to
            raise InputError(
                f"{folder}: a broken link to {os.readlink(folder)} (nothing at {os.path.realpath(folder)}); "
                "the artifact and its source were moved apart (quantize with --copy for an artifact that moves alone)"
            )
        if not folder.is_dir():
            library, class_name = component_class(model_index, name)
            raise InputError(
                f"{model_dir / MODEL_INDEX}: component {name!r} ({library}.{class_name}) has no folder {model_dir / name}"
            )


def component_class(model_index: dict[str, Any], component: str) -> tuple[str, str]:
    value = model_index.get(component)
    if not (isinstance(value, list) and len(value) == 2 and value[0] is not None):
        raise InputError(
            f"{MODEL_INDEX}: no component {component!r} (have: {', '.join(component_names(model_index))})"
        )
    return str(value[0]), str(value[1])


def load_component_config(component_dir: Path) -> dict[str, Any]:
    return read_json(Path(component_dir) / "config.json")


# A variant's files, as diffusers and transformers name them: the variant before the last extension
# (``diffusion_pytorch_model.fp16.safetensors``, ``model.fp16-00001-of-00002.safetensors``,
# ``diffusion_pytorch_model.safetensors.index.fp16.json``). Default names have no dot in their stem.
_VARIANT_WEIGHTS = re.compile(r"^[^.]+\.(?P<variant>[^.-]+)(-\d{5}-of-\d{5})?\.safetensors$")
_VARIANT_INDEX = re.compile(r"^[^.]+\.safetensors\.index\.(?P<variant>[^.]+)\.json$")


def variant_of(name: str) -> str | None:
    """The variant a weight or index file name carries (``fp16``), or None for a default file."""
    match = _VARIANT_WEIGHTS.match(name) or _VARIANT_INDEX.match(name)
    return match["variant"] if match else None


def is_weight_file(name: str) -> bool:
    """Whether ``name`` is a safetensors weight file or index, of any variant."""
    return name.endswith(".safetensors") or bool(
        re.match(r"^[^.]+\.safetensors\.index(\.[^.]+)?\.json$", name)
    )


def weight_files(component_dir: Path, variant: str | None = None) -> list[Path]:
    """The safetensors files of a component (of ``variant``, else the default ones), in a stable order; every
    shard an index names must exist."""
    component_dir = Path(component_dir)
    if not component_dir.is_dir():
        raise InputError(f"{component_dir}: component directory not found")
    present = sorted(p for p in component_dir.iterdir() if is_weight_file(p.name))
    mine = [p for p in present if variant_of(p.name) == variant]
    indexes = [p for p in mine if p.name.endswith(".json")]
    if len(indexes) > 1:
        raise InputError(
            f"{component_dir}: more than one safetensors index ({', '.join(p.name for p in indexes)})"
        )
    if indexes:
        weight_map = read_json(indexes[0]).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise InputError(f"{indexes[0]}: no weight_map")
        for shard in weight_map.values():  # a shard is a file of the component, never a path out of it
            if (
                not isinstance(shard, str)
                or PurePosixPath(shard).is_absolute()
                or ".." in PurePosixPath(shard).parts
            ):
                raise InputError(
                    f"{indexes[0]}: weight_map names {shard!r}, not a file inside {component_dir}"
                )
        shards = sorted(set(weight_map.values()))
        for shard in shards:
            if not (component_dir / shard).exists():
                raise InputError(f"{component_dir / shard}: shard named by {indexes[0].name} is missing")
        return [component_dir / shard for shard in shards]
    files = [p for p in mine if p.name.endswith(".safetensors")]
    if not files:
        others = sorted({v for p in present if (v := variant_of(p.name)) is not None})
        wanted = f"{variant} variant " if variant else ""
        hint = f" (variants here: {', '.join(others)}; choose one with --variant)" if others else ""
        raise InputError(f"{component_dir}: no {wanted}.safetensors weights{hint}")
    return files


def tensor_files(component_dir: Path) -> dict[str, Path]:
    """Tensor name -> the file that holds it, read from the safetensors headers (no tensor data is read)."""
    from safetensors import safe_open

    locations: dict[str, Path] = {}
    for path in weight_files(component_dir):
        try:
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                    locations[name] = path
        except Exception as error:  # safetensors raises its own types for truncated or corrupt headers
            raise InputError(f"{path}: not a readable safetensors file ({error})") from error
    return locations


def quantization_config_of(config: dict[str, Any], component: str) -> dict[str, Any] | None:
    """The compressed-tensors config that applies to ``component``, or None.

    Accepts the per-component wrapper (``{"transformer": {...}}``) and the
    plain form (``{"quant_method": "compressed-tensors", ...}``); both
    spellings of the method name resolve.
    """
    raw = config.get("quantization_config")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise InputError(f"{component}/config.json: quantization_config is not an object")
    if "quant_method" not in raw:
        raw = raw.get(component)
        if raw is None:
            return None
        if not isinstance(raw, dict) or "quant_method" not in raw:
            raise InputError(f"{component}/config.json: quantization_config.{component} has no quant_method")
    try:
        normalize_quant_method(str(raw["quant_method"]))
    except InputError as error:
        raise InputError(f"{component}/config.json: quantization_config: {error}") from None
    return raw
