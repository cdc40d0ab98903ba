"""The quantize stage: a diffusers model directory in, a compressed-tensors artifact out, and its verification.

- ``targets``: which Linears of a component are quantized, read from the model's own structure, and why not the
  rest (and which modules a pipeline never reads);
- ``quantizer``: the offline quantizer (``ditq quantize``), streaming each component through ``rewrite``;
- ``links``: how the source's entries it does not rewrite are held: a relative link, a copy or an absolute link;
- ``plan_file`` / ``plan_apply``: the mixed-precision plan file (PLAN.json) it reads, and its layers applied;
- ``in_memory``: ``ditq.quantize_`` (a loaded model's Linears quantized in place, by the same rule and code) and
  ``ditq.save`` (the quantizer writing its artifact with those layers);
- ``verifier``: ``ditq verify``, digests and every quantized tensor decoded twice.

``quantize`` and ``verify`` here are the public entry points; they import the stage only when called, so ``import
ditq`` stays light. The package is callable too: ``ditq.quantize(SRC, OUT, "fp8")`` calls ``quantize``, while
``ditq.quantize.targets`` (and ``import ditq.quantize.targets as targets``) is the module, as for any package.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ditq.quantize.quantizer import QuantizeResult
    from ditq.quantize.verifier import VerifyReport

__all__ = ["quantize", "verify"]


def quantize(
    source: str | Path, output: str | Path, scheme: str | None = None, **options: Any
) -> QuantizeResult:
    """Quantize a diffusers model directory into an artifact: ``ditq.quantize.quantizer.quantize``, whose keyword
    options (``components``, ``plan``, ``targets``, ``device``...) it takes."""
    from ditq.quantize.quantizer import quantize as run

    return run(source, output, scheme, **options)


def verify(artifact: str | Path, source: str | Path | None = None) -> VerifyReport:
    """Check an artifact (and, with ``source``, its fidelity to it): ``ditq.quantize.verifier.verify``."""
    from ditq.quantize.verifier import verify as run

    return run(artifact, source)


class _CallablePackage(types.ModuleType):
    """This package, called: ``ditq.quantize(...)`` is ``quantize(...)``."""

    def __call__(
        self, source: str | Path, output: str | Path, scheme: str | None = None, **options: Any
    ) -> Any:
        return quantize(source, output, scheme, **options)


sys.modules[__name__].__class__ = _CallablePackage
