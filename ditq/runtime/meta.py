"""A component built from its config with every parameter on the meta device: no weight memory until filled.

``torch.nn.Module.register_parameter`` is patched for the duration of the
build (process-wide: no other thread may build modules meanwhile); buffers
stay real, so tables computed at construction (rotary frequencies) survive.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ditq.checkpoint.component import from_config

__all__ = ["build_empty", "parameters_on_meta"]


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside the block lives on the meta device; buffers stay real."""
    original = torch.nn.Module.register_parameter

    def register(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None:
            module._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=False)

    torch.nn.Module.register_parameter = register  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original  # type: ignore[method-assign]


def build_empty(cls: Any, config: dict[str, Any], component_dir: Path) -> torch.nn.Module:
    """An instance from config with parameters on meta (diffusers ModelMixin or transformers PreTrainedModel);
    build it with ``ditq.checkpoint.component.build_on_meta`` first, which checks its declared sizes."""
    plain = {k: v for k, v in config.items() if k != "quantization_config"}
    with parameters_on_meta():
        model = from_config(cls, plain, f"{component_dir}/config.json")
    return model.eval()
