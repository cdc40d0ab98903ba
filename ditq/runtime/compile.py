"""``--compile``: the pipeline's transformer compiled with torch.compile, as it will serve.

The transformer is the component that runs at every denoising step, so it is the one ``--compile`` compiles. Where
the model declares its repeated blocks (diffusers' ``_repeated_blocks``), each block class is compiled once and
every block reuses the code (diffusers' regional compilation, ``compile_repeated_blocks``): compiling one 60-block
model costs what compiling one block does. Elsewhere the whole transformer is compiled.

``--compile`` also compiles the text encoder's decoder layers where the text encoder is quantized
(``compile_pipeline(..., text_encoder=...)``, ``compile_text_encoder``; the loader passes it only then: on an H100
a BF16 encoder's compiled layers ran 1.6-2.3x slower than its eager ones, the fp8 encoder's 0.52-0.97x, run 8).
The encoder runs once a request, at a few hundred tokens, where an 8-bit layer's eager host time (its activation
quantization and its GEMM launched op by op) exceeds its device time: on the H200 the eager fp8 encoder took 84 ms
where BF16's took 53 (run 7 of ``benchmarks/results/h200-served-compile``). Its
decoder layers (a transformers model's ``_no_split_modules`` inside its ``get_decoder()``: Qwen3-VL's language
model, not its vision tower) are compiled as the transformer's blocks are, so the quantization can fuse into the
norm before it. The vision tower is left eager: its attention splits the patches per image with ``tolist()``, which
would tie a graph to each reference count and size, and a new reference size would compile during a request. The
compiled encoder's KV cache is switched off (``use_cache``): a text encoder's pass reads hidden states only, and the
cache indexes its layers by number, which dynamo would take for a constant (a graph per layer). An encoder that
declares no repeated layers (ditq's demo encoder) stays eager. ``benchmarks/text_encoder_bench.py`` times it, eager
against compiled.

``--compile`` compiles the VAE's decoder as well (``compile_vae_decoder``), once a request but a hundred-odd
milliseconds of eager elementwise passes around its convolutions at 1024x1024.

Compilation happens on the first call of each code path (references or none, the prefix step or a cached one),
so a server runs every path it will accept before it serves (``ditq.serve.cost.calibrate`` runs each calibration
shape once to warm up, then measures it). The blocks are compiled with dynamic shapes from the first call, so one
graph per path serves every image size, reference size and prompt length: left to itself, dynamo would compile
each path first for its exact sizes and again at the first request whose sizes differ (a 4-reference request took
10-13 s where it takes 1.5 s eager on the H200). Two more things would tie a graph to the warm-up's sizes:
- duck shaping, which takes two sizes that happen to be equal during warm-up (a cache's stride and the image's)
  for one symbol; it is turned off;
- the block's prefix boundary, which diffusers passes as a ``slice`` whose bounds dynamo keeps as constants until
  it has seen a second value (calibration warms its smallest shape up at three prompt lengths for that).
Its limit on recompilations is raised so that a server never falls back to eager code silently. Qwen-Image-2.1's
prefill attention loops over the prefix's segments, a loop dynamo would unroll (a prefix graph per reference
count); its model family hands the segments to the compiled blocks as a table and the loop runs in one op
(``ditq.runtime.models.qwenimage21.prefill``; ``ModelFamily.prepare_compiled_block`` and ``compiled_block_arguments``).

The compiled code is kept across restarts in ditq's cache folder (``compile_cache``: inductor's FX graph, AOTAutograd
and autotuning caches, and the Triton kernels under them, in ``$DITQ_CACHE_DIR/inductor``, else
``~/.cache/ditq/inductor``; a ``TORCHINDUCTOR_CACHE_DIR`` the environment sets is kept). A server started again at the
same shapes traces its graphs again but takes their code from the cache; ``CompileFacts`` counts the graphs served
from it (``cache_hits``) and compiled anew (``cache_misses``), so /health says whether a start was cold or warm.

ditq's 8-bit kernels are custom ops with shape-only fakes (``ditq.kernels.cuda_common``,
``ditq.kernels.reference``), so the compiler keeps each as one call and fuses the activation quantization into
the op that produced its input.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.fx.experimental._config as fx_config
from torch._dynamo.utils import counters

from ditq.errors import InputError
from ditq.fsutil import user_cache_dir
from ditq.runtime.models import ModelFamily, model_family

__all__ = [
    "COMPILE_BACKENDS",
    "CompileFacts",
    "compile_blocks",
    "compile_cache",
    "compile_pipeline",
    "compile_text_encoder",
    "compile_vae_decoder",
    "compiled_graphs",
    "decoder_layers",
    "repeated_blocks",
]

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
    module: str  # the components compiled (``transformer`` or ``transformer, text_encoder``)
    how: str  # "repeated blocks (N x Class)" or "whole module"; per component where several were compiled
    warmup_seconds: float | None = None  # the first call at each warmed-up shape: compilation and warm-up
    warmup_graphs: int | None = None  # graphs dynamo compiled during the warm-up
    cache: str | None = None  # the folder of the compiled code kept across restarts (``compile_cache``)
    cache_hits: int | None = None  # graphs of the warm-up whose code came from that cache
    cache_misses: int | None = None  # graphs of the warm-up compiled anew (and stored there)
    # dynamo's graph count (process-wide) once warmed up: what /health's graphs_since_warmup counts from
    graphs_at_warmup_end: int | None = field(default=None, repr=False)
    _cache_at_start: tuple[int, int] = field(default=(0, 0), repr=False)

    def warmed_up(self, seconds: float, graphs_at_start: int) -> None:
        """Record a finished warm-up that began when dynamo had compiled ``graphs_at_start`` graphs (the cache's
        counts since this value was made)."""
        self.warmup_seconds = round(seconds, 3)
        self.graphs_at_warmup_end = compiled_graphs()
        self.warmup_graphs = self.graphs_at_warmup_end - graphs_at_start
        hits, misses = _cache_counts()
        self.cache_hits, self.cache_misses = hits - self._cache_at_start[0], misses - self._cache_at_start[1]

    def to_json(self) -> dict[str, Any]:
        facts = asdict(self)
        at_end = facts.pop("graphs_at_warmup_end")
        facts.pop("_cache_at_start")
        # graphs compiled since the warm-up: a request that paid a compilation (0 is the goal)
        facts["graphs_since_warmup"] = None if at_end is None else compiled_graphs() - at_end
        return facts


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process."""
    return int(counters["stats"]["unique_graphs"])


def _cache_counts() -> tuple[int, int]:
    """(hits, misses) of inductor's FX graph cache in this process."""
    return int(counters["inductor"]["fxgraph_cache_hit"]), int(counters["inductor"]["fxgraph_cache_miss"])


def compile_cache() -> str:
    """Keep inductor's compiled code in ditq's cache folder (``$DITQ_CACHE_DIR/inductor``, else
    ``~/.cache/ditq/inductor``) unless the environment names a ``TORCHINDUCTOR_CACHE_DIR`` of its own; its FX graph
    and AOTAutograd caches on. Returns the folder."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen is None or os.path.abspath(chosen) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(user_cache_dir() / "inductor")
    torch._inductor.config.fx_graph_cache = True
    torch._functorch.config.enable_autograd_cache = True
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def _declared(
    module: torch.nn.Module, attribute: str, root: torch.nn.Module | None = None
) -> list[torch.nn.Module]:
    """Instances inside ``root`` (default ``module``) of the classes ``module``'s ``attribute`` names."""
    names = set(getattr(module, attribute, None) or ())
    found = (root if root is not None else module).modules()
    return [m for m in found if type(m).__name__ in names] if names else []


def _blocks_text(blocks: list[torch.nn.Module]) -> str:
    """'repeated blocks (N x Class)', as /health and the report show what was compiled."""
    return f"repeated blocks ({len(blocks)} x {', '.join(sorted({type(b).__name__ for b in blocks}))})"


def repeated_blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks diffusers' ``compile_repeated_blocks`` compiles: instances of the classes ``_repeated_blocks``
    names (none where the model declares none)."""
    return _declared(module, "_repeated_blocks")


def decoder_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """A transformers text encoder's repeated layers: instances of the classes its ``_no_split_modules`` names,
    inside its decoder (``get_decoder()``, Qwen3-VL's language model) where it has one. None where it names none."""
    get_decoder = getattr(module, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    return _declared(module, "_no_split_modules", decoder if isinstance(decoder, torch.nn.Module) else None)


def _without_kv_cache(module: torch.nn.Module) -> None:
    """Switch off the KV cache of every config inside ``module`` (a text encoder's pass reads hidden states)."""
    for sub in module.modules():
        config = getattr(sub, "config", None)
        if config is not None and hasattr(config, "use_cache"):
            config.use_cache = False


def _call_compiled(
    compiled: Callable[..., Any],
    block: torch.nn.Module,
    family: ModelFamily | None,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """A compiled block's call (``nn.Module._compiled_call_impl``). A ``slice`` among its keyword arguments goes in
    as the index tensor of the same positions: dynamo keeps a slice's bounds as constants (a graph for every prompt
    length), where a tensor's length is a dynamic size. Indexing by it copies what slicing would view, the same
    values. Assumes bounded, non-negative slices (diffusers passes ``slice(0, prefix_len)``): ``arange`` refuses an
    open end.

    The hidden states reach the compiled code at storage offset 0: the first block's are a view into the joint
    sequence, the others' fresh tensors, and dynamo specialises an offset of 0 apart from any other, so the cached
    step would compile twice. The copy is the image tokens' once per step.

    The block's model family rewrites what else would tie a graph to one call (``compiled_block_arguments``:
    Qwen-Image-2.1's prefix segments go in as a table, not a list whose length dynamo would guard)."""
    if family is not None:
        family.compiled_block_arguments(block, kwargs)
    slices = {name: v for name, v in kwargs.items() if isinstance(v, slice)}
    if slices:
        device = next(v.device for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor))
        kwargs |= {
            name: torch.arange(v.start or 0, v.stop, v.step or 1, device=device) for name, v in slices.items()
        }
    hidden = kwargs.get("hidden_states")
    if isinstance(hidden, torch.Tensor) and hidden.storage_offset():
        kwargs["hidden_states"] = hidden.clone()
    return compiled(*args, **kwargs)


def _serving_settings() -> None:
    """Dynamo's process-wide settings for serving: no duck shaping, and room for every path's graph."""
    fx_config.use_duck_shape = False
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, _RECOMPILE_LIMIT)
    torch._dynamo.config.accumulated_recompile_limit = max(
        torch._dynamo.config.accumulated_recompile_limit, 16 * _RECOMPILE_LIMIT
    )


def compile_blocks(blocks: list[torch.nn.Module], backend: str, fullgraph: bool = False) -> None:
    """Compile ``blocks`` as a server does: diffusers' ``compile_repeated_blocks`` (every block one code object, so
    one cache), with dynamic shapes, slices as index tensors, and each block readied by its model family where it has
    one (``_call_compiled``; Qwen-Image-2.1's blocks take the prefix segments as a table).
    ``benchmarks/dit_bench.py`` times the served path through it."""
    _serving_settings()
    for block in blocks:
        family = model_family(block)
        if family is not None:
            family.prepare_compiled_block(block)
        compiled = torch.compile(block._call_impl, backend=backend, dynamic=True, fullgraph=fullgraph)
        block._compiled_call_impl = functools.partial(_call_compiled, compiled, block, family)


def compile_text_encoder(encoder: torch.nn.Module, backend: str) -> str | None:
    """Compile ``encoder``'s decoder layers (``decoder_layers``) with its KV cache off; what was compiled
    ("repeated blocks (N x Class)"), or None where it declares no repeated layers (it stays eager)."""
    layers = decoder_layers(encoder)
    if not layers:
        return None
    _without_kv_cache(encoder)
    compile_blocks(layers, backend)
    return _blocks_text(layers)


def compile_vae_decoder(vae: Any, backend: str) -> str | None:
    """Compile ``vae``'s decoder (``vae.decoder``: what ``vae.decode`` runs once per frame, once a request) as one
    module with dynamic shapes; what was compiled, or None where the VAE has no decoder module (it stays as it is).

    Eager, the decoder runs its normalisations (in float32), activations and causal paddings op by op around every
    convolution, each a pass over a full-resolution activation; compiled, they fuse: Qwen-Image-2.1's decode at
    1024x1024 took 84.3 ms against 120.9 on an H100 (``benchmarks/decode_answer_bench.py``,
    ``benchmarks/results/h100-served-speed/``). Dynamic shapes without duck shaping (``_serving_settings``) keep one
    graph for every image size; with duck shaping (a square image's sides one symbol) or static shapes it ran in
    68-70 ms, but a new size compiled again for 20-50 s, which a request would pay. Channels-last weights were slower,
    eager (141.6 ms) and compiled (83.1), so the layout stays. The pixels differ from the untouched decode's by
    reordered rounding only (at most 4 of 255 levels, 0.58 on average, in BF16 on the H100;
    ``tests/runtime/test_compile.py`` bounds it on the CPU)."""
    decoder = getattr(vae, "decoder", None)
    if not isinstance(decoder, torch.nn.Module):
        return None
    _serving_settings()
    decoder.compile(backend=backend, dynamic=True)
    return f"decoder ({type(decoder).__name__})"


def compile_pipeline(
    pipeline: Any, backend: str, component: str = "transformer", text_encoder: str | None = None
) -> CompileFacts:
    """Compile ``pipeline``'s ``component`` (its repeated blocks where it declares them) with ``backend``, the
    decoder layers of the component named ``text_encoder`` where it declares them (None: the transformer only;
    ``--compile`` names ``text_encoder``), and the VAE's decoder where the pipeline has one (``compile_vae_decoder``)
    and is not placed by ``--offload auto``.

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
    blocks = repeated_blocks(module)
    if blocks:
        compile_blocks(blocks, backend)
        how = _blocks_text(blocks)
    else:
        _serving_settings()
        module.compile(backend=backend, dynamic=True)
        how = "whole module"
    encoder = getattr(pipeline, text_encoder, None) if text_encoder else None
    encoder_how = compile_text_encoder(encoder, backend) if isinstance(encoder, torch.nn.Module) else None
    parts = [(component, how)]
    if encoder_how is not None:
        parts.append((str(text_encoder), encoder_how))
    # under --offload auto the VAE may stream from host memory, now or after a demotion, through hooks that move its
    # weights as it runs, which a compiled graph would trace: its decoder stays eager there (not run on a GPU)
    placed = getattr(pipeline, "ditq_placement", None) is not None
    if (
        not placed
        and (decoder_how := compile_vae_decoder(getattr(pipeline, "vae", None), backend)) is not None
    ):
        parts.append(("vae", decoder_how))
    if len(parts) > 1:
        how = "; ".join(f"{name}: {text}" for name, text in parts)
        component = ", ".join(name for name, _ in parts)
    facts = CompileFacts(backend, component, how, cache=compile_cache(), _cache_at_start=_cache_counts())
    pipeline.ditq_compile = facts  # what serve's calibration and generate warm up, and /health shows
    logger.info("compiling %s with %s: %s (on the first call at each shape)", component, backend, how)
    return facts
