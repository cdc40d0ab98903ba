"""Finding the Python classes a diffusers directory names: each component's and the pipeline's, from the trusted
libraries only (``ditq.checkpoint.component.TRUSTED_LIBRARIES``)."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from ditq.checkpoint.component import import_class, is_trusted_library
from ditq.checkpoint.layout import component_class, component_names
from ditq.errors import InputError

__all__ = ["import_class", "pipeline_class"]


def pipeline_class(model_index: dict[str, Any], model_dir: Path) -> type:
    """The pipeline class named by ``_class_name``: from diffusers, else from a component's library or its parents
    (the demo's pipeline beside its text encoder), never from a library outside the trusted ones."""
    name = model_index.get("_class_name")
    where = f"{model_dir}/model_index.json"
    if not isinstance(name, str) or not name.isidentifier():
        raise InputError(f"{where}: no _class_name naming a pipeline class")
    import diffusers

    if name in dir(diffusers):  # dir() lists the lazy names without importing every submodule
        return _pipeline(getattr(diffusers, name), f"diffusers.{name}", where)
    for component in component_names(model_index):
        library, class_name = component_class(model_index, component)
        import_class(library, class_name, f"{where}: {component}")  # refuses an untrusted library
        parts = library.split(".")
        for parent in (".".join(parts[:depth]) for depth in range(len(parts), 0, -1)):
            if not is_trusted_library(parent):
                break  # "ditq.demo", never "ditq"
            module = importlib.import_module(parent)
            if isinstance(getattr(module, name, None), type):
                return _pipeline(getattr(module, name), f"{parent}.{name}", where)
    raise InputError(f"{where}: pipeline class {name!r} not found in diffusers or the components' libraries")


def _pipeline(cls: Any, named: str, where: str) -> type:
    if not isinstance(cls, type) or not callable(getattr(cls, "from_pretrained", None)):
        raise InputError(f"{where}: {named} is not a pipeline class")
    return cls
