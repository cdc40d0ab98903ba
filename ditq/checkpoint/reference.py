"""compressed-tensors' own decoder, as an independent check on ditq's.

The compressor comes from compressed-tensors' ``BaseCompressor`` registry,
keyed by the format the config names, and the scheme from its own
``QuantizationConfig`` parsing of the config we wrote. compressed-tensors
0.20 exposes class-level ``decompress(state_dict, scheme)``; 0.19 has
instances from ``load_from_registry(format, config=...)`` with
``decompress_weight(compressed_data, quantization_args)``. Both are served.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["ReferenceDecoder"]


class ReferenceDecoder:
    """Decode one Linear's stored tensors with compressed-tensors, for the config ``plain``."""

    def __init__(self, plain: dict[str, Any]) -> None:
        from compressed_tensors.compressors import BaseCompressor
        from compressed_tensors.quantization import QuantizationConfig

        self.config = QuantizationConfig.model_validate(plain)
        (self.scheme,) = self.config.config_groups.values()
        self.format = str(plain["format"])
        compressor = BaseCompressor.get_value_from_registry(self.format)
        if hasattr(compressor, "decompress_weight"):  # compressed-tensors 0.19: instance interface
            self._instance = BaseCompressor.load_from_registry(self.format, config=self.config)
        else:
            self._instance = None
        self._compressor = compressor

    def decode(self, stored: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """(out, in) weight as compressed-tensors dequantizes it (float32 for float32 scales)."""
        tensors = dict(stored)
        if self._instance is not None:
            return self._instance.decompress_weight(
                compressed_data=tensors, quantization_args=self.scheme.weights
            )
        return self._compressor.decompress(tensors, self.scheme)["weight"]
