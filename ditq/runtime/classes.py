"""Finding the Python classes a diffusers directory names: each component's and the pipeline's."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from ditq.checkpoint.layout import component_class, component_names
from ditq.errors import InputError

__all__ = ["import_class", "pipeline_class"]


def import_class(library: str, class_name: str, where: str) -> Any:
    """``library.class_name``; an InputError naming ``where`` when the library or the class is missing."""
    try:
        module = importlib.import_module(library)
    except ImportError as error:
        raise InputError(f"{where}: cannot import library {library!r} ({error})") from error
    cls = getattr(module, class_name, None)
    if cls is None:
        raise InputError(f"{where}: library {library!r} has no class {class_name!r}")
    return cls


def pipeline_class(model_index: dict[str, Any], model_dir: Path) -> type:
    """The pipeline class named by ``_class_name``: from diffusers, else from a component's library or its parents."""
    name = model_index.get("_class_name")
    if not isinstance(name, str):
        raise InputError(f"{model_dir}/model_index.json: no _class_name")
    import diffusers

    if name in dir(diffusers):  # dir() lists the lazy names without importing every submodule
        return getattr(diffusers, name)
    for component in component_names(model_index):
        library, _ = component_class(model_index, component)
        parts = library.split(".")
        for depth in range(len(parts), 0, -1):
            try:
                module = importlib.import_module(".".join(parts[:depth]))
            except ImportError:
                continue
            if isinstance(getattr(module, name, None), type):
                return getattr(module, name)
    raise InputError(
        f"{model_dir}/model_index.json: pipeline class {name!r} not found in diffusers or the components' libraries"
    )
