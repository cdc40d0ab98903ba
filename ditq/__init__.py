"""ditq: 8-bit diffusion transformers as servable compressed-tensors checkpoints, with evidence."""

from __future__ import annotations

from ditq.lazy import lazy_names

__version__ = "0.1.0"

# Public API name -> module that defines it; imported on first use so `import ditq` stays light.
_LAZY: dict[str, str] = {
    "load_pipeline": "ditq.pipeline.open",
    "load_component": "ditq.runtime.loader",
    "quantize": "ditq.quantization.quantizer",
    "verify": "ditq.quantization.verifier",
    "quantize_": "ditq.quantization.in_memory",
    "save": "ditq.quantization.in_memory",
}

__all__ = ["__version__", "load_component", "load_pipeline", "quantize", "quantize_", "save", "verify"]


__getattr__ = lazy_names(__name__, _LAZY)


def __dir__() -> list[str]:
    """What ``import ditq`` offers: its public API, the lazily imported names included."""
    return sorted(__all__)
