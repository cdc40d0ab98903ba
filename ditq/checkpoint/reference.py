"""compressed-tensors' own decoder, as an independent check on ditq's.

The scheme comes from compressed-tensors' own ``QuantizationConfig`` parsing of the config, and, where the
config has several groups (mixed precision), the group of a layer from its own matching (``is_match``: exact
names, ``re:`` patterns, class names, less ``ignore``); the compressor comes from its ``BaseCompressor``
registry, keyed by the group's ``format`` (else the config's, else the one compressed-tensors infers for a
Linear of that scheme, as its decompressors do when the top level says ``mixed-precision``). ``decompress``
(the class-level interface of compressed-tensors 0.19 and 0.20) turns one Linear's stored tensors back into its
weight.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ditq.errors import InputError

__all__ = ["ReferenceDecoder"]

_MIXED_PRECISION = "mixed-precision"


class ReferenceDecoder:
    """Decode one Linear's stored tensors with compressed-tensors, for the plain config ``plain``."""

    def __init__(self, plain: dict[str, Any]) -> None:
        from compressed_tensors.quantization import QuantizationConfig

        self.config = QuantizationConfig.model_validate(plain)
        self.format = plain.get("format")

    def _scheme(self, name: str, module: torch.nn.Module | None) -> Any:
        from compressed_tensors.utils.match import is_match

        groups = list(self.config.config_groups.values())
        if len(groups) == 1:
            return groups[0]
        if module is None:
            raise ValueError("a config of several groups needs the layer's name and module to pick its group")
        for scheme in groups:
            if is_match(name, module, scheme.targets, self.config.ignore or ()):
                return scheme
        raise InputError(f"compressed-tensors matches {name} to none of the config's groups")

    def decode(
        self, stored: Mapping[str, torch.Tensor], name: str = "", module: torch.nn.Module | None = None
    ) -> torch.Tensor:
        """(out, in) weight as compressed-tensors dequantizes it (float32 for float32 scales). ``name`` and
        ``module`` (the Linear) pick the group where the config has several."""
        from compressed_tensors.compressors import BaseCompressor
        from compressed_tensors.compressors.format import infer_module_format

        scheme = self._scheme(name, module)
        fmt = scheme.format or (self.format if self.format != _MIXED_PRECISION else None)
        if fmt is None:
            fmt = infer_module_format(torch.nn.Linear, scheme)
        compressor = BaseCompressor.get_value_from_registry(str(getattr(fmt, "value", fmt)))
        return compressor.decompress(dict(stored), scheme)["weight"]
