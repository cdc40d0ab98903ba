"""Running ditq artifacts: quantized Linear modules, the loader, offload, and the pipeline adapter."""

from __future__ import annotations

from ditq.runtime.adapter import GenerationRequest, GenerationResult, PipelineAdapter

__all__ = ["GenerationRequest", "GenerationResult", "PipelineAdapter"]
