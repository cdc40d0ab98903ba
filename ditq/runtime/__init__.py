"""Running ditq artifacts: quantized Linear and token-embedding modules, the loader, offload, the pipeline adapter, and how a pipeline
is opened as one value (``LoadOptions``, which the opener one stage up, ``ditq.pipeline.open_pipeline``, takes).

The adapter's names import eagerly (they are light); the loader and modules on first use, so
``import ditq.runtime`` does not pull in diffusers.
"""

from __future__ import annotations

from ditq.lazy import lazy_names
from ditq.runtime.adapter import GenerationRequest, GenerationResult, PipelineAdapter

# Public name -> module that defines it, imported on first use.
_LAZY: dict[str, str] = {
    "LoadOptions": "ditq.runtime.options",
    "resolve_load_options": "ditq.runtime.options",
    "load_component": "ditq.runtime.loader",
    "prepare_quantized": "ditq.runtime.loader",
    "QuantizedEmbedding": "ditq.runtime.embedding",
    "QuantizedLinear": "ditq.runtime.modules",
    "linear_from_stored": "ditq.runtime.modules",
    "quantized_linear_class": "ditq.runtime.modules",
    "quantized_linears": "ditq.runtime.modules",
    "OFFLOAD_MODES": "ditq.devices",
}

__all__ = ["GenerationRequest", "GenerationResult", "PipelineAdapter", *_LAZY]


__getattr__ = lazy_names(__name__, _LAZY)
