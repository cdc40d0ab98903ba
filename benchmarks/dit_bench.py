"""Qwen-Image-2.1 DiT: the denoising loop as the pipeline runs it, BF16 vs every ditq scheme and torchao.

The model is diffusers' ``QwenImage21Transformer2DModel`` at its default config with random weights drawn
by diffusers' own initialisation (what ``from_config`` gives after ``torch.manual_seed``; ``--init normal002``:
every matrix normal(0, 0.02), which makes the random 32-block model chaotic), in BF16 on one device.

Loop rows: for each variant (BF16, ditq w8a8 / fp8 / w8a16, torchao int8 dynamic and float8 rowwise) and mode
(eager; compiled: diffusers' regional compilation of the repeated blocks), the denoising loop at 0-4
references at 1024x1024 (4096 latent tokens per image, 256 text tokens): one prefix-extracting step
(text + reference tokens prefilled into the KV cache) then ``--loop-steps`` cached steps, run by diffusers'
own ``QwenImage21Pipeline.__call__`` with only the text encoder and VAE left out (``dit_loop.py`` says how).
Each row gives the prefix step's ms, the cached steps' median ms, the loop's total, each as a ratio to BF16 in
the same mode, the final latents' relative L2 against BF16 eager's (same inputs), the weight bytes and the
peak device memory as if the variant were alone. Per variant a per-layer error: every quantized Linear's
output against its BF16 Linear on the same captured input (median, max, the worst five).

Quantized variants take the Linears the quantizer would (``ditq.quantization.targets.plan_targets``) and run the kernel
path ``ditq serve`` would choose (``ditq.doctor.choose_kernel``; ``--skip-doctor``: the registry's first,
unverified), with their projections apart, as ``ditq.load_pipeline`` loads them by default; ``w8a8-fused`` and
``fp8-fused`` run the same schemes with query/key/value and gate/up fused into one GEMM each
(``ditq.runtime.fuse``, ``load_pipeline(fuse=True)``), at 0 and 4 references, to show what the fusion gives. w8a8
goes through the real loader (artifact written, ``ditq.load_component`` + repack: the load row). torchao's variants quantize the same BF16 weights with ``torchao.quantization.quantize_``
(``Int8DynamicActivationInt8WeightConfig()``, ``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())``)
on the same target Linears; they run compiled only, with the inductor settings torchao's configs set
(``set_inductor_config=True``, its default), which are restored for every other variant. Compilation uses
static shapes (``automatic_dynamic_shapes`` off): each reference count and step kind gets its own graph.
``--compile-shapes served`` compiles as ``ditq serve --compile`` does instead (``ditq.runtime.compile.compile_blocks``:
dynamic shapes, one graph per path, every variant alike).

On an H200, in one call (about 8 minutes; the budget keeps it inside):

    python benchmarks/dit_bench.py --out $OUT/dit_bench_CARD_COMMIT.json --budget-s 400 --loop-steps 9

It needs diffusers (0.42.1 measured) and, for its rows, torchao (0.17 measured); where torchao does not import,
its rows are "unavailable: <reason>" in the JSON. CPU dry run (tiny model, every step; compiled rows traced by dynamo
with the "eager" backend, so no code is generated; one thread, since a shared CPU makes the tiny timings noise
anyway), under a minute:

    OMP_NUM_THREADS=1 python benchmarks/dit_bench.py --preset tiny --device cpu --out /tmp/dit_bench_tiny.json

Time at full size, estimated from the last result (BF16 eager forward 152 ms at 0 references, 860 ms at 4;
compiled w8a8 96 ms; a first compilation about 9 s): an eager loop row costs its warm-up (prefix + one cached
step) and one timed loop, about 2 s at 0 references and 4 s at 4; a compiled row adds the compilation of its
two graphs (about 10-20 s, static shapes); the w8a8 load 15 s; a per-layer error one forward. First the rows
at 0 and 4 references of BF16, w8a8 and fp8, eager and compiled (about 160 s), then torchao float8 rowwise and
int8 (about 40 s each), then 1-3 references eager (about 30 s), w8a16 (about 20 s) and 1-3 references compiled
(about 18 s a row). Work runs in priority order under the wall-clock budget; whatever does not fit is listed
under "skipped" in the JSON, never silently dropped, and the JSON is rewritten after every step.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))  # full_size_pipeline

import full_size_pipeline  # noqa: E402
from dit_loop import LoopCase, layer_errors, loop_pipeline, make_case, profile_loop, time_loop  # noqa: E402
from result_names import result_path  # noqa: E402

from ditq.checkpoint.codecs import codec_for  # noqa: E402
from ditq.checkpoint.qconfig import quantization_config, with_quantization_config  # noqa: E402
from ditq.doctor import VerifiedChooser, kernel_chooser  # noqa: E402
from ditq.numerics import quantize_weight, relative_l2  # noqa: E402
from ditq.quantization.targets import plan_targets  # noqa: E402
from ditq.runtime.compile import compile_blocks, repeated_blocks  # noqa: E402
from ditq.runtime.fuse import fuse_projections  # noqa: E402
from ditq.runtime.loader import load_component, parameters_on_meta, prepare_quantized  # noqa: E402
from ditq.runtime.modules import linear_from_stored, quantized_linears  # noqa: E402
from ditq.schemes import get_scheme  # noqa: E402

# name -> (transformer config overrides, text tokens, image grid side in latent tokens). "tiny" is a CPU dry run.
PRESETS: dict[str, tuple[dict[str, Any], int, int]] = {
    "full": ({}, 256, 64),  # 1024 px / (VAE 16) = 64 tokens a side
    "tiny": (
        dict(
            num_layers=2,
            attention_head_dim=32,
            num_attention_heads=2,
            context_in_dim=64,
            in_channels=64,
            out_channels=64,
            axes_dims_rope=(8, 12, 12),
        ),
        32,
        8,
    ),
}
REFERENCES = (0, 1, 2, 3, 4)
SCHEMES = ("w8a8", "fp8", "w8a16")
FOUR_BIT = ("w4a8", "w4a8-channel", "w4a16")
# w4a8 with one scale per output channel (``ditq quantize --group-size channel``): cuBLAS's rowwise fp8 GEMM where
# groups of 128 take its 1x128 blockwise one
PER_CHANNEL = {"w4a8-channel": "w4a8"}
# the same schemes with their projections fused (``ditq.runtime.fuse``; ``load_pipeline(fuse=True)``), to show what
# the fusion gives
FUSED = {"w8a8-fused": "w8a8", "fp8-fused": "fp8"}
# the fp8 scheme with fast accumulation (``--accumulate fast``: scaled-mm-fp8-fast where the doctor passes it)
FAST = {"fp8-fast": "fp8"}
# variant -> (the variant whose model it runs, its attention): ditq's quantized attention (``--attention``, the
# doctor-chosen path, installed for the row and removed after it) over a quantized model, and BF16 through
# PyTorch's cuDNN SDPA backend (eager only: the backend is chosen when a graph is traced) for comparison with
# the default SDPA backend every other row uses.
ATTENTION_VARIANTS: dict[str, tuple[str, str]] = {
    "fp8+attn-int8-fp8": ("fp8", "int8-fp8"),
    "fp8+attn-fp8-fp8": ("fp8", "fp8-fp8"),  # cuDNN's fp8 flash attention
    "fp8-fast+attn-fp8-fp8": ("fp8-fast", "fp8-fp8"),
    "w8a8+attn-int8": ("w8a8", "int8"),
    "bf16+sdpa-cudnn": ("bf16", "sdpa-cudnn"),
}
PROFILED_REFERENCES = (0, 4)  # --profile: the rows profiled
# name -> (variant and mode measured, variant and mode it is divided by, the ratio that meets it, strict: the ratio
# must be below it rather than at most it). The ratio is of loop_ms (lower is better), judged at each reference count
# where both rows exist; issue 16 judges it with 4 references.
GOALS: dict[str, tuple[tuple[str, str], tuple[str, str], float, bool]] = {
    "w4a8_compiled_loop_vs_fp8_compiled": (("w4a8", "compiled"), ("fp8", "compiled"), 1.10, False),
    "w4a8_channel_compiled_loop_vs_fp8_compiled": (
        ("w4a8-channel", "compiled"),
        ("fp8", "compiled"),
        1.10,
        False,
    ),
    "w8a8_eager_loop_vs_bf16_eager": (("w8a8", "eager"), ("bf16", "eager"), 0.80, False),
    "w8a8_compiled_loop_vs_bf16_compiled": (("w8a8", "compiled"), ("bf16", "compiled"), 0.80, False),
    "fp8_compiled_loop_vs_torchao_fp8row_compiled": (
        ("fp8", "compiled"),
        ("torchao-fp8row", "compiled"),
        1.0,
        True,  # "faster than"
    ),
    "fp8_attn_int8_fp8_compiled_loop_vs_bf16_compiled": (
        ("fp8+attn-int8-fp8", "compiled"),
        ("bf16", "compiled"),
        0.75,
        False,
    ),
}
# Issue 43's goals, judged at every reference count: (numerator, denominator, ratio at most, field)
STEP_GOALS: dict[str, tuple[tuple[str, str], tuple[str, str], float, str]] = {
    "fp8_fast_attn_fp8_fp8_cached_step_vs_bf16_compiled": (
        ("fp8-fast+attn-fp8-fp8", "compiled"),
        ("bf16", "compiled"),
        0.65,
        "cached_step_ms",
    ),
    "fp8_attn_fp8_fp8_cached_step_vs_bf16_compiled": (
        ("fp8+attn-fp8-fp8", "compiled"),
        ("bf16", "compiled"),
        0.65,
        "cached_step_ms",
    ),
    "fp8_fast_attn_fp8_fp8_loop_vs_torchao_fp8row_compiled": (
        ("fp8-fast+attn-fp8-fp8", "compiled"),
        ("torchao-fp8row", "compiled"),
        1.0,
        "loop_ms",
    ),
    "fp8_fast_loop_vs_torchao_fp8row_compiled": (
        ("fp8-fast", "compiled"),
        ("torchao-fp8row", "compiled"),
        1.0,
        "loop_ms",
    ),
}
INFORMATION = {  # ratios reported beside the goals, with no bar
    "fp8_eager_loop_vs_bf16_eager": (("fp8", "eager"), ("bf16", "eager")),
    "fp8_compiled_loop_vs_bf16_compiled": (("fp8", "compiled"), ("bf16", "compiled")),
    "w8a8_compiled_loop_vs_torchao_int8dyn_compiled": (("w8a8", "compiled"), ("torchao-int8dyn", "compiled")),
    "bf16_compiled_loop_vs_bf16_eager": (("bf16", "compiled"), ("bf16", "eager")),
    "w8a8_attn_int8_eager_loop_vs_bf16_eager": (("w8a8+attn-int8", "eager"), ("bf16", "eager")),
    "fp8_attn_int8_fp8_eager_loop_vs_bf16_eager": (("fp8+attn-int8-fp8", "eager"), ("bf16", "eager")),
    "bf16_sdpa_cudnn_eager_loop_vs_bf16_eager": (("bf16+sdpa-cudnn", "eager"), ("bf16", "eager")),
    **{
        f"{scheme}_fused_{mode}_loop_vs_unfused": ((variant, mode), (scheme, mode))
        for variant, scheme in FUSED.items()
        for mode in ("eager", "compiled")
    },
}
WEIGHT_BYTES_VS_BF16_MAX = 0.53
FIELDS = {  # what each number of a loop row is
    "prefix_step_ms": "the first denoising step (kv_cache_mode 'extract': every token, prefix K/V cached), ms",
    "cached_step_ms": "median of the later steps (kv_cache_mode 'cached': target tokens only), ms",
    "loop_ms": "one whole loop (1 prefix + loop_steps cached steps, scheduler steps included), ms",
    "*_vs_bf16_same_mode": "this row's time over BF16's in the same mode at the same reference count (lower is better)",
    "final_latents_rel_l2_vs_bf16_eager": "||latents - latents_bf16_eager|| / ||latents_bf16_eager|| after the loop",
    "final_latents_rel_l2_vs_bf16_compiled": "the same against BF16 compiled's latents (a run without eager rows)",
    "weight_bytes": "bytes of every tensor the variant holds (shared BF16 tensors counted once)",
    "peak_bytes_alone": "weight_bytes + the timed loops' device-memory peak above what was held before them",
    "warmup_seconds": "the untimed warm-up loop (prefix + one cached step), compilation included",
    "dynamo_graphs": "graphs dynamo compiled during this row: 0 in eager; 3 at a new shape (the prefix step's, and "
    "the cached step's twice: its first block gets a strided slice of the joint sequence, the others contiguous)",
    "graph_breaks": "graph breaks dynamo recorded during this row",
    "layer_errors": "per variant: rel-L2 of each quantized Linear's output vs its BF16 Linear on the same input",
    "attention_path": "quantized-attention rows: the path the doctor chose (or 'sdpa-cudnn')",
    "profile": "--profile, at 0 and 4 references: one loop of 3 steps (prefix + 2 cached) under torch.profiler, "
    "device time by kernel category, the busiest kernels, wall vs device-busy time",
}


class Budget:
    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["capability"] = list(torch.cuda.get_device_capability())
    for name in ("diffusers", "triton", "torchao"):
        try:
            env[name] = __import__(name).__version__
        except Exception as error:
            env[name] = f"unavailable: {error!r}"[:200]
    try:
        env["git_commit"] = subprocess.check_output(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, text=True, stderr=subprocess.DEVNULL
        ).strip()
    except (OSError, subprocess.CalledProcessError):
        # A copy of the tree without .git (a remote runner): the caller may say which commit it is.
        env["git_commit"] = os.environ.get("DITQ_SOURCE_COMMIT", "unknown")
    return env


def build_bf16(config: dict[str, Any], device: torch.device, seed: int, init: str) -> torch.nn.Module:
    """Random BF16 weights on the device: diffusers' own initialisation ("default") or normal(0, 0.02) ("normal002")."""
    from diffusers import QwenImage21Transformer2DModel

    model: Any
    if init == "default":
        torch.manual_seed(seed)
        with torch.device(device):  # drawn in float32 as diffusers does, then cast (torch's `to`: no warning)
            model = torch.nn.Module.to(QwenImage21Transformer2DModel.from_config(config), torch.bfloat16)
        return model.eval().requires_grad_(False)
    with parameters_on_meta():
        model = QwenImage21Transformer2DModel(**config)
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in list(model.named_parameters()):
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        tensor = torch.empty(param.shape, dtype=torch.bfloat16, device=device)
        if param.ndim >= 2:
            tensor.normal_(0.0, 0.02, generator=generator)
        elif attr == "weight":
            tensor.fill_(1.0)
        else:
            tensor.zero_()
        module._parameters[attr] = torch.nn.Parameter(tensor, requires_grad=False)
    return model.to(device).eval()


def target_prefixes(model: torch.nn.Module) -> list[str]:
    shapes = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    return sorted(plan_targets(model, "transformer", shapes).targets)


def quantized_copy(
    bf16: torch.nn.Module,
    config: dict[str, Any],
    scheme_name: str | None,
    targets: list[str],
    fuse: bool = False,
) -> torch.nn.Module:
    """The same model with ``targets`` as ditq QuantizedLinears (quantized on the device); other tensors shared.
    With ``fuse``, the projections that read one input are fused as the loader fuses them.

    ``scheme_name`` None: a second model object over the very same BF16 parameters (for torchao to quantize).
    """
    from diffusers import QwenImage21Transformer2DModel

    with parameters_on_meta():
        model: Any = QwenImage21Transformer2DModel(**config)
    replaced = set(targets) if scheme_name is not None else set()
    for prefix in sorted(replaced):
        linear = bf16.get_submodule(prefix)
        assert isinstance(linear, torch.nn.Linear)
        scheme = get_scheme(PER_CHANNEL.get(scheme_name, scheme_name))  # type: ignore[arg-type]
        if scheme_name in PER_CHANNEL:
            scheme = scheme.with_group_size(None)
        scheme = scheme.fitted(linear.in_features)
        q, scale = quantize_weight(linear.weight, scheme)
        layer = linear_from_stored(codec_for(scheme).encode(q, scale), scheme, linear.bias)
        parent, _, attr = prefix.rpartition(".")
        setattr(model.get_submodule(parent), attr, layer)
    for name, param in bf16.named_parameters():
        module_name, _, attr = name.rpartition(".")
        if module_name in replaced:
            continue
        model.get_submodule(module_name)._parameters[attr] = param
    device = next(bf16.parameters()).device
    if fuse:
        fuse_projections(model)
    return model.to(device).eval()


def _storages(tensor: torch.Tensor) -> dict[int, int]:
    """data pointer -> bytes of every storage behind ``tensor`` (tensor subclasses such as torchao's unwrapped)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        found: dict[int, int] = {}
        for name in names:
            found.update(_storages(getattr(tensor, name)))
        return found
    storage = tensor.untyped_storage()
    return {storage.data_ptr(): storage.nbytes()}


def tensor_bytes(model: torch.nn.Module) -> int:
    storages: dict[int, int] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        storages.update(_storages(tensor))
    return sum(storages.values())


class RegionalCompilation:
    """diffusers' ``compile_repeated_blocks`` per variant, switched off for eager rows and on again for compiled ones.

    The compiled callables are kept, so switching back reuses dynamo's cache (a fresh ``torch.compile`` wrapper
    would count as another backend and compile again).
    """

    def __init__(self, backend: str, served: bool) -> None:
        self.backend = backend
        self.served = served  # ditq serve's compilation (dynamic shapes) instead of diffusers' static one
        self.calls: dict[int, list[Any]] = {}

    def set_mode(self, model: torch.nn.Module, mode: str, fullgraph: bool) -> None:
        blocks = repeated_blocks(model)
        if mode == "eager":
            for block in blocks:
                block._compiled_call_impl = None
        elif id(model) not in self.calls:
            if self.served:
                compile_blocks(blocks, self.backend, fullgraph)
            else:
                model.compile_repeated_blocks(fullgraph=fullgraph, backend=self.backend)  # type: ignore[operator]
            self.calls[id(model)] = [block._compiled_call_impl for block in blocks]
        else:
            for block, call in zip(blocks, self.calls[id(model)], strict=True):
                block._compiled_call_impl = call


@contextmanager
def attention_installed(pipe: Any, attention: str | None, verify: bool) -> Iterator[str | None]:
    """Inside the block the pipeline's transformer attends as ``attention`` says (None: as it was built;
    ``sdpa-cudnn``: PyTorch's cuDNN SDPA backend only; ``int8``/``fp8``: ditq's quantized attention, the path
    ``ditq serve --attention`` would choose); yields the path's name. The processors are restored after."""
    if attention is None:
        yield None
        return
    if attention == "sdpa-cudnn":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            yield attention
        return
    from ditq.doctor.attention import attention_chooser
    from ditq.runtime.attention import install_attention

    saved = pipe.transformer.attn_processors  # diffusers' own save and restore of every attention processor
    try:
        device = next(pipe.transformer.parameters()).device
        choice = install_attention(
            pipe, attention, attention_chooser(attention, device, torch.bfloat16, verify)
        )
        yield choice.path.name
    finally:
        pipe.transformer.set_attn_processor(saved)


def dynamo_counts() -> tuple[int, int]:
    """(graphs dynamo compiled so far, graph breaks so far)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"]), int(sum(counters["graph_break"].values()))


@contextmanager
def inductor_settings(saved: bytes | None) -> Iterator[None]:
    """Inductor's config (and the float32 matmul precision) as ``saved`` inside the block, as before it after."""
    import torch._inductor.config as inductor_config

    if saved is None:
        yield
        return
    before, precision = inductor_config.save_config(), torch.get_float32_matmul_precision()
    inductor_config.load_config(saved)
    torch.set_float32_matmul_precision("high")  # recommended_inductor_config_setter sets it with the rest
    try:
        yield
    finally:
        inductor_config.load_config(before)
        torch.set_float32_matmul_precision(precision)


def torchao_configs() -> dict[str, Any]:
    """variant -> torchao config; raises ImportError where torchao is missing."""
    from torchao.quantization import (
        Float8DynamicActivationFloat8WeightConfig,
        Int8DynamicActivationInt8WeightConfig,
        PerRow,
    )

    return {
        "torchao-fp8row": Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()),
        "torchao-int8dyn": Int8DynamicActivationInt8WeightConfig(),
    }


def torchao_copy(
    bf16: torch.nn.Module, config: dict[str, Any], targets: list[str], torchao_config: Any
) -> tuple[torch.nn.Module, bytes]:
    """(a model over the BF16 parameters with ``targets`` quantized by torchao, the inductor config torchao set).

    ``quantize_`` gives each target Linear a new weight Parameter, so the BF16 model keeps its own; the global
    inductor settings it makes are taken out again and returned, to be applied around torchao's rows only.
    """
    import torch._inductor.config as inductor_config
    from torchao.quantization import quantize_

    model = quantized_copy(bf16, config, None, targets)
    target_set = set(targets)
    before, precision = inductor_config.save_config(), torch.get_float32_matmul_precision()
    quantize_(model, torchao_config, filter_fn=lambda module, fqn: fqn in target_set)
    torchao_settings = inductor_config.save_config()
    inductor_config.load_config(before)
    torch.set_float32_matmul_precision(precision)
    return model, torchao_settings


def kernel_counts(model: torch.nn.Module) -> dict[str, int]:
    counts: dict[str, int] = {}
    for layer in quantized_linears(model).values():
        name = layer.kernel.name if layer.kernel is not None else "unchosen"
        counts[name] = counts.get(name, 0) + 1
    return counts


def write_artifact(model: Any, targets: list[str], root: Path) -> int:
    """A one-component w8a8 artifact of ``model`` (stored tensors before any repack); returns its bytes."""
    from safetensors.torch import save_file

    folder = root / "transformer"
    folder.mkdir(parents=True)
    index = {
        "_class_name": "DiffusionPipeline",
        "transformer": ["diffusers", "QwenImage21Transformer2DModel"],
    }
    (root / "model_index.json").write_text(json.dumps(index))
    ignored = sorted(
        n for n, m in model.named_modules() if type(m) is torch.nn.Linear and n not in set(targets)
    )
    full_config = {k: v for k, v in dict(model.config).items() if not k.startswith("_")}
    full_config["_class_name"] = "QwenImage21Transformer2DModel"
    plain = quantization_config(get_scheme("w8a8"), ignored)
    (folder / "config.json").write_text(
        json.dumps(with_quantization_config(full_config, "transformer", plain, "flat"))
    )
    shard: dict[str, torch.Tensor] = {}
    size, shards, weight_map = 0, 0, {}
    state = model.state_dict()

    def flush() -> None:
        nonlocal shard, size, shards
        if shard:
            shards += 1
            file_name = f"diffusion_pytorch_model-{shards:05d}.safetensors"
            save_file(shard, str(folder / file_name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file_name))
        shard, size = {}, 0

    for name, tensor in state.items():
        shard[name] = tensor.detach().to("cpu").contiguous()
        size += tensor.numel() * tensor.element_size()
        if size >= 2 << 30:
            flush()
    flush()
    index_doc = {"metadata": {}, "weight_map": weight_map}
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index_doc))
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def measure_load(
    root: Path, device: torch.device, artifact_bytes: int, chooser: VerifiedChooser | None
) -> tuple[torch.nn.Module, dict[str, Any]]:
    _sync()
    before = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    model = load_component(root, "transformer", device=device, dtype=torch.bfloat16)
    loaded = time.perf_counter() - start
    choosing = chooser.seconds if chooser is not None else 0.0
    prepare_quantized(model, device, torch.bfloat16, chooser)
    _sync()
    total = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated() - before) if torch.cuda.is_available() else 0
    component_bytes = tensor_bytes(model)
    largest = max(
        tensor_bytes(layer) for layer in [*quantized_linears(model).values(), *model.transformer_blocks]
    )
    bound = int(1.1 * (component_bytes + largest))
    return model, {
        "artifact_bytes": artifact_bytes,
        "load_seconds": round(loaded, 3),
        "load_and_repack_seconds": round(total, 3),
        # of which: the doctor's checks choosing the paths (kernel compilation included; cached after one run)
        "kernel_choice_seconds": round(chooser.seconds - choosing, 3) if chooser is not None else None,
        "peak_accelerator_bytes_while_loading": peak,
        "component_bytes_after_load": component_bytes,
        "largest_module_bytes": largest,
        "bound_bytes (component + largest module + 10%)": bound,
        "within_bound": peak <= bound if torch.cuda.is_available() else None,
        "kernels": kernel_counts(model),
    }


def estimate_seconds(mode: str, references: int, loop_steps: int, repeats: int) -> float:
    """A loop row's seconds on an H200 at full size (the last result's forward times; compilation about 20 s)."""
    prefix = 0.16 + 0.18 * references  # BF16 eager forward: 152 ms at 0 references, 860 ms at 4
    cached = 0.15 + 0.02 * references  # target tokens only; attention over the growing prefix
    seconds = prefix + cached + repeats * (prefix + loop_steps * cached)
    return seconds + (20.0 if mode == "compiled" else 0.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=tuple(PRESETS), default="full")
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--budget-s", type=float, default=400.0, help="wall-clock budget for the measurements"
    )
    parser.add_argument("--loop-steps", type=int, default=9, help="cached steps after the prefix step (>= 1)")
    parser.add_argument("--repeats", type=int, default=1, help="timed loops per row, after one warm-up loop")
    parser.add_argument("--init", choices=("default", "normal002"), default="default")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--compile-backend",
        choices=("inductor", "aot_eager", "eager"),
        help="torch.compile's backend (default: inductor on CUDA; eager elsewhere: dynamo traces every variant "
        "(graph breaks, recompiles), no code is generated)",
    )
    parser.add_argument(
        "--compile-shapes",
        choices=("static", "served"),
        default="static",
        help="compiled rows: static (a graph per shape, diffusers' regional compilation) or served (what ditq serve "
        "--compile runs: dynamic shapes, one graph per path; ditq.runtime.compile.compile_blocks) (default: static)",
    )
    parser.add_argument("--out", type=Path, default=result_path("dit_bench"))
    parser.add_argument(
        "--artifact-dir", type=Path, help="where to write the load test's artifact (temp dir)"
    )
    parser.add_argument(
        "--skip-doctor", action="store_true", help="the registry's first kernel paths, unverified"
    )
    parser.add_argument(
        "--variants", help="comma list: only these variants' steps (e.g. bf16,w8a8; default: every variant)"
    )
    parser.add_argument("--modes", help="comma list: only these modes' rows (eager, compiled; default: both)")
    parser.add_argument("--references", help="comma list: only these reference counts' rows (default: 0-4)")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also profile every row at 0 and 4 references (one 3-step loop each): device time by kernel category",
    )
    args = parser.parse_args()
    if args.loop_steps < 1 or args.repeats < 1:
        parser.error("--loop-steps and --repeats must be at least 1")
    chooser = None if args.skip_doctor else kernel_chooser()
    budget = Budget(args.budget_s)
    device = torch.device(args.device)
    backend = args.compile_backend or ("inductor" if device.type == "cuda" else "eager")
    overrides, text, grid = PRESETS[args.preset]
    config = dict(overrides)  # the class defaults, but for the dry-run preset
    served = args.compile_shapes == "served"
    torch._dynamo.config.automatic_dynamic_shapes = served  # static: one graph per shape
    torch._dynamo.config.recompile_limit = (
        256  # variants x step kinds x reference counts share one code object
    )
    torch._dynamo.config.accumulated_recompile_limit = 8192
    result: dict[str, Any] = {
        "command": "python " + " ".join(sys.argv),
        "environment": environment(),
        "model": {
            "class": "QwenImage21Transformer2DModel",
            "config_overrides": overrides,
            "weights": f"random, init {args.init!r} (default: diffusers' from_config), seed {args.seed}",
        },
        "loop": {
            "driver": "diffusers QwenImage21Pipeline.__call__ with encode_prompt and prepare_latents "
            "returning seeded normal tensors (no text encoder, no VAE); see benchmarks/dit_loop.py",
            "steps": 1 + args.loop_steps,
            "cached_steps": args.loop_steps,
            "repeats": args.repeats,
            "text_tokens": text,
            "image_tokens_per_image": grid * grid,
            "scheduler": "FlowMatchEulerDiscreteScheduler, full_size_pipeline.SCHEDULER_CONFIG",
        },
        "compile": {
            "how": "ditq serve's: ditq.runtime.compile.compile_blocks (regional), dynamic shapes"
            if served
            else "diffusers compile_repeated_blocks (regional), static shapes",
            "backend": backend,
            "fullgraph": "True for BF16 and ditq; False for torchao",
        },
        "fields": FIELDS,
        "rows": [],
        "layer_errors": {},
        "skipped": [],
        "unavailable": {},
        # true only in the last write, once every planned step ran, failed or was skipped (each listed): a file a
        # killed run left says false, and its missing rows are listed nowhere else
        "finished": False,
        "goals": {name: {"ratio_max": bar, "strict": strict} for name, (_, _, bar, strict) in GOALS.items()},
    }
    rows: list[dict[str, Any]] = result["rows"]
    bf16 = build_bf16(config, device, args.seed, args.init)
    targets = target_prefixes(bf16)
    bf16_bytes = tensor_bytes(bf16)
    result["model"]["quantized_linears"] = len(targets)
    processor = full_size_pipeline.build_processor(
        full_size_pipeline.PRESETS["tiny"]
    )  # read by __init__ only
    models: dict[str, torch.nn.Module] = {"bf16": bf16}
    pipes: dict[str, Any] = {}
    cases: dict[int, LoopCase] = {}
    torchao_inductor: dict[str, bytes] = {}
    bf16_latents: dict[tuple[str, int], torch.Tensor] = {}
    compilation = RegionalCompilation(backend, served)

    def case(references: int) -> LoopCase:
        if references not in cases:
            cases[references] = make_case(config, text, grid, references, device)
        return cases[references]

    def pipe(variant: str) -> Any:
        base = ATTENTION_VARIANTS.get(variant, (variant, None))[0]
        if base not in pipes:
            pipes[base] = loop_pipeline(models[base], processor, full_size_pipeline.SCHEDULER_CONFIG)
        return pipes[base]

    def loop_row(variant: str, mode: str, references: int) -> None:
        base, attention = ATTENTION_VARIANTS.get(variant, (variant, None))
        model = models[base]
        fullgraph = not variant.startswith("torchao")  # ditq's custom ops must trace without a graph break
        key = {"variant": variant, "mode": mode, "references": references}
        profile = None
        with inductor_settings(torchao_inductor.get(variant)):
            graphs, breaks = dynamo_counts()
            try:
                with attention_installed(pipe(variant), attention, verify=not args.skip_doctor) as path:
                    compilation.set_mode(model, mode, fullgraph)
                    timing = time_loop(pipe(variant), case(references), 1 + args.loop_steps, args.repeats)
                    if args.profile and references in PROFILED_REFERENCES:
                        profile = profile_loop(pipe(variant), case(references), 3)
            except Exception as error:  # recorded: one broken row must not hide the others
                rows.append({**key, "error": repr(error)[:800]})
                print(f"{variant:>15} {mode:>8} r{references}: ERROR {error!r}"[:400], flush=True)
                return
            finally:
                compilation.set_mode(model, "eager", fullgraph)
            graphs_after, breaks_after = dynamo_counts()
        latents = timing.latents.float()
        if variant == "bf16":
            bf16_latents[mode, references] = latents
        reference, compiled_reference = (bf16_latents.get((m, references)) for m in ("eager", "compiled"))
        weight_bytes = tensor_bytes(model)
        row = {
            **key,
            "joint_tokens_at_prefix_step": case(references).joint_tokens,
            "prefix_step_ms": round(timing.prefix_step_ms, 2),
            "cached_step_ms": round(timing.cached_step_ms, 2),
            "loop_ms": round(timing.loop_ms, 2),
            "cached_steps_ms": [round(ms, 2) for ms in timing.cached_steps_ms],
            "final_latents_rel_l2_vs_bf16_eager": None
            if reference is None
            else round(relative_l2(latents, reference), 5),
            "final_latents_rel_l2_vs_bf16_compiled": None
            if compiled_reference is None
            else round(relative_l2(latents, compiled_reference), 5),
            "weight_bytes": weight_bytes,
            "peak_bytes_alone": weight_bytes + timing.peak_bytes,
            "warmup_seconds": round(timing.warmup_seconds, 1),
            "dynamo_graphs": graphs_after - graphs,
            "graph_breaks": breaks_after - breaks,
        }
        if base in SCHEMES or base in FUSED or base in FAST or base in FOUR_BIT:
            row["kernels"] = kernel_counts(model)
        if attention is not None:
            row["attention_path"] = path
        if profile is not None:
            row["profile"] = profile
        if variant in torchao_inductor:
            row["inductor_config"] = "torchao's recommended settings (set_inductor_config=True)"
        rows.append(row)
        print(
            f"{variant:>15} {mode:>8} r{references}: prefix {timing.prefix_step_ms:9.2f} ms  cached "
            f"{timing.cached_step_ms:9.2f} ms  loop {timing.loop_ms:10.2f} ms  warm-up {timing.warmup_seconds:6.1f} s",
            flush=True,
        )

    def load_w8a8() -> None:
        """w8a8 through the real loader: artifact on disk -> load_component on the device -> repack."""
        artifact_root = args.artifact_dir or Path(tempfile.mkdtemp(prefix="ditq-dit-bench-"))
        try:
            staged = quantized_copy(bf16, config, "w8a8", targets)
            artifact_bytes = write_artifact(staged, targets, artifact_root / "w8a8")
            del staged
            gc.collect()
            models["w8a8"], result["load"] = measure_load(
                artifact_root / "w8a8", device, artifact_bytes, chooser
            )
        finally:
            shutil.rmtree(artifact_root, ignore_errors=True)

    def in_memory(scheme: str) -> None:
        models[scheme] = quantized_copy(
            bf16, config, FUSED.get(scheme, FAST.get(scheme, scheme)), targets, fuse=scheme in FUSED
        )
        fast = None if chooser is None else VerifiedChooser("fast")
        prepare_quantized(models[scheme], device, torch.bfloat16, fast if scheme in FAST else chooser)

    def release(variant: str) -> None:  # a comparison's model, dropped once its rows ran
        models.pop(variant, None)
        pipes.pop(variant, None)

    def with_torchao(variant: str, torchao_config: Any) -> None:
        models[variant], torchao_inductor[variant] = torchao_copy(bf16, config, targets, torchao_config)

    def layer_error(variant: str) -> None:
        result["layer_errors"][variant] = layer_errors(pipe(variant), case(0), bf16, targets)

    scale = 1.0 if args.preset == "full" else 0.01

    def row(variant: str, mode: str, references: int) -> tuple[str, float, Callable[[], None]]:
        seconds = scale * estimate_seconds(mode, references, args.loop_steps, args.repeats)
        if args.profile and references in PROFILED_REFERENCES:
            seconds += scale * estimate_seconds("eager", references, 2, 1) / 2  # one 3-step loop more
        return f"{variant} {mode} loop r{references}", seconds, lambda: loop_row(variant, mode, references)

    ends, middle = (0, 4), (1, 2, 3)
    # the earlier comparisons' attention rows here; cuDNN's fp8 attention's rows with the fast variant's, below
    attention_variants = [v for v in ("fp8+attn-int8-fp8", "w8a8+attn-int8", "bf16+sdpa-cudnn")
                          if device.type == "cuda" or v != "bf16+sdpa-cudnn"]  # fmt: skip
    if "bf16+sdpa-cudnn" not in attention_variants:
        result["skipped"].append("bf16+sdpa-cudnn: cuDNN attention needs CUDA")
    plan: list[tuple[str, float, Callable[[], None]]] = [
        row("bf16", "eager", 0),
        row("bf16", "eager", 4),
        ("w8a8 artifact write + load", 15 * scale, load_w8a8),
        row("w8a8", "eager", 0),
        row("w8a8", "eager", 4),
        ("w8a8 layer errors", 3 * scale, lambda: layer_error("w8a8")),
        ("fp8 quantize", 2 * scale, lambda: in_memory("fp8")),
        row("fp8", "eager", 0),
        row("fp8", "eager", 4),
        ("fp8 layer errors", 3 * scale, lambda: layer_error("fp8")),
        *(row(variant, "eager", r) for variant in attention_variants for r in ends),
        *(row(variant, "compiled", r) for variant in ("bf16", "w8a8", "fp8") for r in ends),
    ]
    try:
        torchao = torchao_configs()
    except ImportError as error:
        torchao = {}
        for variant in ("torchao-fp8row", "torchao-int8dyn"):
            result["unavailable"][variant] = f"unavailable: {error!r}"[:300]
            result["skipped"].append(f"{variant}: unavailable: {error!r}"[:300])
    for variant, torchao_config in torchao.items():
        plan += [
            (f"{variant} quantize", 5 * scale, functools.partial(with_torchao, variant, torchao_config)),
            *(row(variant, "compiled", r) for r in ends),
            (f"{variant} layer errors", 3 * scale, functools.partial(layer_error, variant)),
        ]
    # issue 43's rows, every reference count on the GPU; the CPU dry run's at 0 and 4 only (its time)
    fast_refs = REFERENCES if args.preset == "full" else ends
    plan += [
        ("fp8-fast quantize", 2 * scale, lambda: in_memory("fp8-fast")),
        *(row(variant, mode, r) for variant in ("fp8-fast", "fp8+attn-fp8-fp8", "fp8-fast+attn-fp8-fp8")
          for mode in ("compiled", "eager") for r in fast_refs),
    ]  # fmt: skip
    for variant in FUSED:
        plan += [
            (f"{variant} quantize", 2 * scale, functools.partial(in_memory, variant)),
            *(row(variant, mode, r) for mode in ("eager", "compiled") for r in ends),
            (f"{variant} release", 0.0, functools.partial(release, variant)),
        ]
    plan += [
        *(row(variant, "compiled", r) for variant in ("fp8+attn-int8-fp8", "w8a8+attn-int8") for r in ends),
        *(row(variant, "eager", r) for variant in ("bf16", "w8a8", "fp8") for r in middle),
        ("w8a16 quantize", 2 * scale, lambda: in_memory("w8a16")),
        ("w8a16 layer errors", 3 * scale, lambda: layer_error("w8a16")),
        *(row("w8a16", "eager", r) for r in REFERENCES),
        *(row(variant, "compiled", r) for variant in ("bf16", "w8a8", "fp8", *torchao) for r in middle),
        *(row("w8a16", "compiled", r) for r in REFERENCES),
    ]
    # issue 46's rows: the 4-bit schemes (round to nearest; the kernels do not see how the values were chosen)
    # (the CPU dry run: w4a8, grouped and per channel, compiled at 0 and 4 references, enough to run every step kind;
    # its time)
    for variant in FOUR_BIT if args.preset == "full" else ("w4a8", "w4a8-channel"):
        modes = ("compiled", "eager") if args.preset == "full" else ("compiled",)
        plan += [
            (f"{variant} quantize", 2 * scale, functools.partial(in_memory, variant)),
            (f"{variant} layer errors", 3 * scale, functools.partial(layer_error, variant)),
            *(row(variant, mode, r) for mode in modes for r in fast_refs),
        ]
    wanted_variants = None if args.variants is None else set(args.variants.split(","))
    wanted_modes = None if args.modes is None else set(args.modes.split(","))

    wanted_references = None if args.references is None else {f"r{r}" for r in args.references.split(",")}

    def wanted(name: str) -> bool:
        words = name.split()
        if wanted_variants is not None and words[0] not in wanted_variants:
            return False
        row_references = words[-1] if re.fullmatch(r"r\d+", words[-1]) else None
        if (
            wanted_references is not None
            and row_references is not None
            and row_references not in wanted_references
        ):
            return False
        modes = {"eager", "compiled"} & set(words)
        return wanted_modes is None or not modes or bool(modes & wanted_modes)

    result["selection"] = {"variants": args.variants, "modes": args.modes, "references": args.references}
    failed: set[str] = set()
    for name, estimate, action in plan:
        if not wanted(name):
            continue
        variant = name.split()[0]
        if variant in failed or ATTENTION_VARIANTS.get(variant, (variant,))[0] in failed:
            result["skipped"].append(f"{name}: an earlier step of {variant} failed or was skipped")
            continue
        if budget.left() < estimate:
            result["skipped"].append(
                f"{name}: wall-clock budget ({budget.left():.0f} s left, needs ~{estimate:.0f} s)"
            )
            if "quantize" in name or "load" in name:
                failed.add(variant)  # the variant's model does not exist
            continue
        start = time.perf_counter()
        try:
            action()
        except Exception as error:  # recorded: one broken step must not hide the others
            if "quantize" in name or "load" in name:
                failed.add(variant)
            result.setdefault("errors", {})[name] = repr(error)[:800]
            print(f"{name}: ERROR {error!r}"[:400], flush=True)
        result.setdefault("step_seconds", {})[name] = round(time.perf_counter() - start, 1)
        # the device memory a step left in reference cycles; on a CPU (the dry run) a collection over dynamo's
        # traced frames took 0.3 s a step, 18 s of the run
        if device.type == "cuda":
            gc.collect()
        save(result, rows, bf16_bytes, args.out)  # after every step: a run cut short still leaves its numbers

    result["finished"] = True
    save(result, rows, bf16_bytes, args.out)
    print_table(rows, result)
    return 0


def save(result: dict[str, Any], rows: list[dict[str, Any]], bf16_bytes: int, out: Path) -> None:
    for row in rows:
        bf16 = find(rows, "bf16", row["mode"], row["references"])
        for field in ("prefix_step", "cached_step", "loop"):
            ours, base = row.get(f"{field}_ms"), None if bf16 is None else bf16.get(f"{field}_ms")
            ratio = None if ours is None or not base else round(ours / base, 3)
            row[f"{field}_vs_bf16_same_mode"] = ratio
    result["summary"] = summarize(rows, bf16_bytes, result.get("load", {}))
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    partial.write_text(json.dumps(result, indent=2) + "\n")
    partial.replace(out)


def find(rows: list[dict[str, Any]], variant: str, mode: str, references: int) -> dict[str, Any] | None:
    for row in rows:
        if (row["variant"], row["mode"], row["references"]) == (
            variant,
            mode,
            references,
        ) and "loop_ms" in row:
            return row
    return None


def summarize(rows: list[dict[str, Any]], bf16_bytes: int, load: dict[str, Any]) -> dict[str, Any]:
    """Each goal's and each reported ratio of loop_ms, at every reference count with both rows measured."""

    def ratios(numerator: tuple[str, str], denominator: tuple[str, str]) -> dict[str, float]:
        found: dict[str, float] = {}
        for references in REFERENCES:
            ours, base = find(rows, *numerator, references), find(rows, *denominator, references)
            if ours is not None and base is not None:
                found[f"r{references}"] = round(ours["loop_ms"] / base["loop_ms"], 3)
        return found

    summary: dict[str, Any] = {"direction": "every ratio: lower is better"}
    for name, (numerator, denominator, bar, strict) in GOALS.items():
        by_references = ratios(numerator, denominator)
        summary[name] = {
            "ratio_max": bar,
            "strict": strict,
            "by_references": by_references,
            "met": {r: (v < bar if strict else v <= bar) for r, v in by_references.items()},
        }
    for name, (numerator, denominator) in INFORMATION.items():
        summary[name] = ratios(numerator, denominator)
    for name, (numerator, denominator, bar, field) in STEP_GOALS.items():
        by_references = {}
        for references in REFERENCES:
            ours, base = find(rows, *numerator, references), find(rows, *denominator, references)
            if ours is not None and base is not None:
                by_references[f"r{references}"] = round(ours[field] / base[field], 3)
        summary[name] = {"field": field, "ratio_max": bar, "by_references": by_references,
                         "met": {r: v <= bar for r, v in by_references.items()}}  # fmt: skip
    for scheme in (*SCHEMES, *FOUR_BIT, "torchao-int8dyn", "torchao-fp8row"):
        weights = [row["weight_bytes"] for row in rows if row["variant"] == scheme and "weight_bytes" in row]
        if weights:
            ratio = weights[0] / bf16_bytes
            summary[f"{scheme}_weight_bytes_vs_bf16"] = {
                "ratio": round(ratio, 3),
                "ratio_max": WEIGHT_BYTES_VS_BF16_MAX,
                "met": ratio <= WEIGHT_BYTES_VS_BF16_MAX,
            }
    if load:
        summary["load_within_accelerator_bound"] = load.get("within_bound")
    return summary


def print_table(rows: list[dict[str, Any]], result: dict[str, Any]) -> None:
    print(
        f"\n{'variant':>15} {'mode':>8} refs {'prefix ms':>10} {'cached ms':>10} {'loop ms':>10} {'vs bf16':>8} {'rel-L2':>8}"
    )
    for row in rows:
        if "error" in row:
            print(f"{row['variant']:>15} {row['mode']:>8} {row['references']:>4} ERROR {row['error'][:60]}")
            continue
        ratio, error = row["loop_vs_bf16_same_mode"], row["final_latents_rel_l2_vs_bf16_eager"]
        if error is None:  # a run without eager rows: against BF16 compiled
            error = row["final_latents_rel_l2_vs_bf16_compiled"]
        print(
            f"{row['variant']:>15} {row['mode']:>8} {row['references']:>4} {row['prefix_step_ms']:>10.2f} "
            f"{row['cached_step_ms']:>10.2f} {row['loop_ms']:>10.2f} {'-' if ratio is None else ratio:>8} "
            f"{'-' if error is None else error:>8}"
        )
    for variant, errors in result["layer_errors"].items():
        print(
            f"layer errors {variant}: median {errors['median']} max {errors['max']} worst {errors['worst_5'][0]}"
        )
    print(f"skipped: {len(result['skipped'])}; errors: {len(result.get('errors', {}))}")
    print(json.dumps({k: v for k, v in result["summary"].items() if k in GOALS}, indent=1))


if __name__ == "__main__":
    raise SystemExit(main())
