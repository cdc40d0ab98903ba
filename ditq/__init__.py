"""ditq: 8-bit diffusion transformers as servable compressed-tensors checkpoints, with evidence."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
