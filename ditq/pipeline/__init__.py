"""The one way to open a pipeline: ``open_pipeline(model, LoadOptions)`` (``open``) and the one-shot ``generate`` (its module)
over it (``ditq generate``).

It stands above the doctor, whose choices of Linear kernels and attention paths it asks for and has the runtime
install, and below every stage that opens a model (serve, the baseline, the planner, the sweep's servers).
``import ditq.pipeline`` imports neither torch nor diffusers; its names load on first use.
"""

from __future__ import annotations

from ditq.lazy import lazy_names

# Public name -> module that defines it, imported on first use.
_LAZY: dict[str, str] = {
    "open_pipeline": "ditq.pipeline.open",
    "load_pipeline": "ditq.pipeline.open",
}

__all__ = [*_LAZY]


__getattr__ = lazy_names(__name__, _LAZY)
