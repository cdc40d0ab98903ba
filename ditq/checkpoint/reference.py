"""compressed-tensors' own decoder, as an independent check on ditq's.

The compressor comes from compressed-tensors' ``BaseCompressor`` registry,
keyed by the format the config names, and the scheme from its own
``QuantizationConfig`` parsing of the config ditq wrote; ``decompress``
(the class-level interface of compressed-tensors 0.19 and 0.20) turns one
Linear's stored tensors back into its weight.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["ReferenceDecoder"]


class ReferenceDecoder:
    """Decode one Linear's stored tensors with compressed-tensors, for the plain config ``plain``."""

    def __init__(self, plain: dict[str, Any]) -> None:
        from compressed_tensors.compressors import BaseCompressor
        from compressed_tensors.quantization import QuantizationConfig

        self.config = QuantizationConfig.model_validate(plain)
        (self.scheme,) = self.config.config_groups.values()
        self.compressor = BaseCompressor.get_value_from_registry(str(plain["format"]))

    def decode(self, stored: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """(out, in) weight as compressed-tensors dequantizes it (float32 for float32 scales)."""
        return self.compressor.decompress(dict(stored), self.scheme)["weight"]
