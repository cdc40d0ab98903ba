"""``--compile``: the pipeline's transformer compiled with torch.compile, as it will serve.

The transformer is the component that runs at every denoising step, so it is the one compiled. Where the model
declares its repeated blocks (diffusers' ``_repeated_blocks``), each block class is compiled once and every block
reuses the code (diffusers' regional compilation, ``compile_repeated_blocks``): compiling one 60-block model costs
what compiling one block does. Elsewhere the whole transformer is compiled.

Compilation happens on the first call at a shape, so a server must run every shape it will accept before it
serves (``ditq.serve.cost.calibrate`` runs each calibration shape once to warm up, then measures it). Dynamo makes
the dimensions that changed between two calls dynamic on its own, so the shapes after the first two reuse one
graph instead of compiling again; its limit on recompilations is raised so that a server never falls back to eager
code silently.

ditq's 8-bit kernels are custom ops with shape-only fakes (``ditq.kernels.cuda_common``,
``ditq.kernels.reference``), so the compiler keeps each as one call and fuses the activation quantization into
the op that produced its input.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ditq.errors import InputError

__all__ = ["COMPILE_BACKENDS", "CompileFacts", "compile_pipeline", "repeated_blocks"]

logger = logging.getLogger(__name__)

# inductor generates code (the speed); aot_eager and eager trace the model without generating any, which checks
# that a model compiles, fast, where a C++ or Triton toolchain is absent
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
_RECOMPILE_LIMIT = (
    64  # per code object; dynamo's default (8) would send a server's later shapes to eager code
)


@dataclass
class CompileFacts:
    """What ``--compile`` did, as /health and the report show it."""

    backend: str
    module: str  # the component compiled (``transformer``)
    how: str  # "repeated blocks (N x Class)" or "whole module"
    warmup_seconds: float | None = None  # the first call at each warmed-up shape: compilation and warm-up

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def repeated_blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks diffusers' ``compile_repeated_blocks`` compiles: instances of the classes ``_repeated_blocks``
    names (none where the model declares none)."""
    names = set(getattr(module, "_repeated_blocks", None) or ())
    return [m for m in module.modules() if type(m).__name__ in names]


def compile_pipeline(pipeline: Any, backend: str, component: str = "transformer") -> CompileFacts:
    """Compile ``pipeline``'s ``component`` (its repeated blocks where it declares them) with ``backend``.

    Nothing is compiled until the first call; ``CompileFacts.warmup_seconds`` is for the caller to fill in once it
    has run the shapes it will serve. The facts are also kept as the pipeline's ``ditq_compile``."""
    if backend not in COMPILE_BACKENDS:
        raise InputError(
            f"--compile-backend: '{backend}' is not one of {', '.join(COMPILE_BACKENDS)}",
            field="compile_backend",
        )
    module = getattr(pipeline, component, None)
    if not isinstance(module, torch.nn.Module):
        raise InputError(f"--compile: the pipeline has no '{component}' module to compile", field="compile")
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, _RECOMPILE_LIMIT)
    torch._dynamo.config.accumulated_recompile_limit = max(
        torch._dynamo.config.accumulated_recompile_limit, 16 * _RECOMPILE_LIMIT
    )
    blocks = repeated_blocks(module)
    if blocks:
        module.compile_repeated_blocks(backend=backend)  # type: ignore[operator]  # diffusers' ModelMixin
        kinds = sorted({type(b).__name__ for b in blocks})
        how = f"repeated blocks ({len(blocks)} x {', '.join(kinds)})"
    else:
        module.compile(backend=backend)
        how = "whole module"
    facts = CompileFacts(backend, component, how)
    pipeline.ditq_compile = facts  # what serve's calibration and generate warm up, and /health shows
    logger.info("compiling %s with %s: %s (on the first call at each shape)", component, backend, how)
    return facts
