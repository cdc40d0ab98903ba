"""ditq: 8-bit diffusion transformers as servable compressed-tensors checkpoints, with evidence."""

from __future__ import annotations

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

# Public API name -> module that defines it; imported on first use so `import ditq` stays light.
_LAZY: dict[str, str] = {
    "quantize": "ditq.quantizer",
    "verify": "ditq.verifier",
    "load_pipeline": "ditq.runtime.loader",
    "load_component": "ditq.runtime.loader",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ditq' has no attribute {name!r}")
