"""Loading diffusers directories whose components may be ditq (compressed-tensors) artifacts.

A component is quantized when its ``config.json`` carries a compressed-tensors
``quantization_config`` (per-component wrapper or plain form). Such a
component is built from its config with every parameter on the meta device
(``ditq.runtime.meta``), each stored quantized Linear is swapped for its
scheme's QuantizedLinear (``ditq.runtime.swap``), and the stored tensors are
read one at a time and assigned in place (``ditq.runtime.fill``): the
source-precision weights of the quantized layers never exist. Every other
component loads the way diffusers loads it. A ditq artifact is read only as far as its manifest lists it
(``ditq.checkpoint.manifest.check_sealed_reads``): a file it does not list, a link it does not record, or a file
behind a link that leads out of the linked folder is refused before anything is built. Modules the artifact's manifest
declares unused (a text encoder's output head) are left out of every component
(``ditq.runtime.unused``). Placement while running is ``ditq.runtime.offload``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ditq.checkpoint.codecs import is_quantized_tensor
from ditq.checkpoint.component import build_on_meta, check_component_classes, refuse_remote_code
from ditq.checkpoint.hub import resolve_model
from ditq.checkpoint.layout import (
    check_components_present,
    component_class,
    component_names,
    is_weight_file,
    load_component_config,
    quantization_config_of,
    read_json,
    read_model_index,
    variant_of,
    weight_files,
)
from ditq.checkpoint.manifest import check_sealed_reads
from ditq.checkpoint.safetensors_io import TensorEntry, read_entry, read_header
from ditq.devices import resolve_device, resolve_dtype
from ditq.errors import InputError, error_line
from ditq.kernels.registry import KernelPath
from ditq.runtime.classes import import_class, pipeline_class
from ditq.runtime.fill import assign_tensor
from ditq.runtime.fuse import fuse_projections, stored_layer_count
from ditq.runtime.meta import build_empty, parameters_on_meta
from ditq.runtime.modules import QuantizedLinear, quantized_linears
from ditq.runtime.offload import apply_offload
from ditq.runtime.options import ResolvedLoad
from ditq.runtime.processors import missing_library, processors_without_video
from ditq.runtime.swap import swap_quantized_linears
from ditq.runtime.unused import drop_unused as drop_unused_modules
from ditq.schemes import Scheme

__all__ = [
    "KernelChooser",
    "check_complete",
    "check_component_sizes",
    "check_tensor_places",
    "component_entries",
    "component_weight_files",
    "file_entries",
    "is_quantized_component",
    "load_component",
    "load_components",
    "parameters_on_meta",
    "pipeline_class",
    "pipeline_summary",
    "prepare_quantized",
    "recorded_unused",
    "recorded_variant",
    "refuse_unconfigured_quantized",
    "stored_layer_schemes",
]

log = logging.getLogger(__name__)

# Decides the kernel path of one layer (e.g. the doctor's verified choice); None = the registry's first candidate.
KernelChooser = Callable[[QuantizedLinear, torch.device, torch.dtype], "KernelPath | None"]


def is_quantized_component(model_dir: Path, component: str) -> dict[str, Any] | None:
    """The component's compressed-tensors config, or None (also for components without config.json)."""
    config_path = Path(model_dir) / component / "config.json"
    if not config_path.is_file():
        return None
    config = load_component_config(config_path.parent)
    qconfig = quantization_config_of(config, component)
    if qconfig is None and config.get("quantization_config") is not None:
        others = ", ".join(sorted(config["quantization_config"]))
        raise InputError(f"{config_path}: quantization_config is for {others}, not for {component}")
    return qconfig


def recorded_variant(model_dir: Path) -> str | None:
    """The source variant a ditq artifact was quantized from (its manifest's ``options.variant``), else None.

    The quantized components carry no variant; the components linked from the source keep the source's files.
    """
    manifest = Path(model_dir) / "MANIFEST.json"
    if not manifest.is_file():
        return None
    options = read_json(manifest).get("options")
    variant = options.get("variant") if isinstance(options, dict) else None
    return variant if isinstance(variant, str) else None


def recorded_unused(model_dir: Path) -> dict[str, dict[str, int]]:
    """Component -> module -> its bytes, for the modules a ditq artifact's manifest declares unused; else empty."""
    manifest = Path(model_dir) / "MANIFEST.json"
    if not manifest.is_file():
        return {}
    unused = read_json(manifest).get("unused")
    if not isinstance(unused, dict):
        return {}
    found: dict[str, dict[str, int]] = {}
    for component, modules in unused.items():
        if not isinstance(modules, dict):
            raise InputError(f"{manifest}: unused.{component} is not an object")
        for module, record in modules.items():
            size = record.get("bytes") if isinstance(record, dict) else None
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise InputError(f"{manifest}: unused.{component}.{module}.bytes is not a byte count")
            found.setdefault(component, {})[module] = size
    return found


def component_weight_files(component_dir: Path, variant: str | None) -> list[Path]:
    """The weight files diffusers' ``from_pretrained(variant=...)`` reads: the variant's where the component has
    them, else the default ones; without a variant, a variant-only component is an InputError naming its variants.
    """
    component_dir = Path(component_dir)
    variants = {variant_of(p.name) for p in component_dir.iterdir() if is_weight_file(p.name)}
    if variant is not None and variant not in variants and None not in variants:
        here = ", ".join(sorted(v for v in variants if v is not None)) or "none"
        raise InputError(
            f"{component_dir}: no {variant} variant and no default .safetensors weights (variants here: {here})"
        )
    return weight_files(component_dir, variant if variant in variants else None)


def refuse_unconfigured_quantized(component_dir: Path, variant: str | None) -> None:
    """A component without a compressed-tensors ``quantization_config`` (none, or null) whose weight files hold
    quantized tensors (int8 or fp8 weights, a weight_scale, packed weights) would load its integers as floats
    and draw garbage: refused, naming the config and the tensor. Only the headers are read."""
    for name, entry in component_entries(component_dir, variant).items():
        if is_quantized_tensor(name, entry.dtype):
            raise InputError(
                f"{component_dir}/config.json: no compressed-tensors quantization_config, but {entry.path.name} "
                f"holds the quantized tensor {name!r} ({str(entry.dtype).removeprefix('torch.')})"
            )


def component_entries(component_dir: Path, variant: str | None) -> dict[str, TensorEntry]:
    """Tensor name -> its safetensors entry, over every weight file of the component (of ``variant``)."""
    return file_entries(component_weight_files(component_dir, variant))


def file_entries(paths: Iterable[Path]) -> dict[str, TensorEntry]:
    """Tensor name -> its safetensors entry, over the weight files ``paths`` (headers only); a tensor in two files
    is an InputError naming both."""
    entries: dict[str, TensorEntry] = {}
    for path in paths:
        for name, entry in read_header(path).entries.items():
            if name in entries:
                raise InputError(f"{path}: tensor {name} also in {entries[name].path.name}")
            entries[name] = entry
    return entries


def check_tensor_places(model: torch.nn.Module, entries: Mapping[str, TensorEntry]) -> None:
    """Every stored tensor has its place in ``model`` (built, its quantized Linears swapped): else an InputError
    naming the file and the tensor."""
    expected = set(model.state_dict(keep_vars=True))
    for name in entries:
        if name not in expected:
            raise InputError(f"{entries[name].path}: tensor {name!r} has no place in {type(model).__name__}")


def check_complete(component_dir: Path, missing: Iterable[str]) -> None:
    """No tensor of the model is ``missing`` from the component's weight files: else an InputError naming the first."""
    names = sorted(missing)
    if names:
        raise InputError(
            f"{component_dir}: tensor {names[0]!r} is missing from the weight files ({len(names)} missing; incomplete artifact)"
        )


def stored_layer_schemes(
    model_dir: str | Path, component: str, variant: str | None = None
) -> dict[str, Scheme]:
    """Prefix of every stored quantized Linear of a compressed-tensors component -> its scheme, decided as the
    loader decides it (the config group that targets it, cross-checked against its tensors); no tensor data is
    read. An InputError names the layer and the file where config and tensors disagree. A quantized token
    embedding is checked as the loader checks it, and left out: no kernel path runs it (``ditq.runtime.embedding``)."""
    model_dir = Path(model_dir)
    qconfig = is_quantized_component(model_dir, component)
    if qconfig is None:
        raise InputError(f"{model_dir / component}/config.json: no compressed-tensors quantization_config")
    library, class_name = component_class(read_model_index(model_dir), component)
    cls = import_class(library, class_name, f"{model_dir}/model_index.json: {component}")
    component_dir = model_dir / component
    refuse_remote_code(component_dir, library)
    entries = component_entries(component_dir, variant)
    model = build_on_meta(cls, load_component_config(component_dir), component_dir, entries, exact=True)
    schemes = swap_quantized_linears(model, entries, qconfig, component_dir, torch.float32)
    return {p: s for p, s in schemes.items() if isinstance(model.get_submodule(p), QuantizedLinear)}


def _load_quantized(
    component_dir: Path,
    cls: Any,
    config: dict[str, Any],
    qconfig: dict[str, Any],
    device: torch.device,
    dtype: torch.dtype,
    variant: str | None,
    unused: list[str],
) -> torch.nn.Module:
    entries = component_entries(component_dir, variant)
    build_on_meta(cls, config, component_dir, entries, exact=True)  # declared sizes, before any real tensor
    model = build_empty(cls, config, component_dir)
    drop_unused_modules(model, component_dir.name, unused)
    entries = {n: e for n, e in entries.items() if not any(n.startswith(f"{m}.") for m in unused)}
    schemes = swap_quantized_linears(model, entries, qconfig, component_dir, dtype)
    check_tensor_places(model, entries)
    for entry in sorted(entries.values(), key=lambda e: (str(e.path), e.begin)):
        assign_tensor(model, entry.name, read_entry(entry), entry, device, dtype)
    tie_weights = getattr(model, "tie_weights", None)
    if callable(tie_weights):
        tie_weights()
    check_complete(component_dir, (n for n, t in model.state_dict(keep_vars=True).items() if t.is_meta))
    model.to(device)  # buffers built on the host (e.g. rotary tables)
    model.ditq_quantization_config = qconfig  # type: ignore[assignment]
    counts: dict[str, int] = {}
    for scheme in schemes.values():
        counts[scheme.name] = counts.get(scheme.name, 0) + 1
    log.info(
        "%s: %s quantized layers (%s), loaded on %s",
        component_dir.name,
        len(schemes),
        ", ".join(f"{n} {s}" for s, n in sorted(counts.items())),
        device,
    )
    return model


def _load_plain(
    component_dir: Path,
    cls: Any,
    device: torch.device,
    dtype: torch.dtype,
    variant: str | None,
    unused: list[str],
) -> Any:
    """A component the way diffusers loads it (models in ``dtype``; schedulers, tokenizers as they are), its
    ``unused`` modules dropped on the host before it moves to ``device``."""
    remote_code = {"trust_remote_code": False} if cls.__module__.startswith("transformers.") else {}
    if isinstance(cls, type) and issubclass(cls, torch.nn.Module):
        if _has_weight_files(component_dir):  # the variant's files where the component has them, as diffusers
            refuse_unconfigured_quantized(component_dir, variant)
            variant = variant if variant_of(component_weight_files(component_dir, variant)[0].name) else None
            check_component_sizes(component_dir, cls, variant)
        model = cls.from_pretrained(str(component_dir), dtype=dtype, variant=variant, **remote_code)  # type: ignore[attr-defined]
        drop_unused_modules(model, component_dir.name, unused)
        return model.to(device)
    return cls.from_pretrained(str(component_dir), **remote_code)


def check_component_sizes(component_dir: Path, cls: type, variant: str | None) -> None:
    """A model component with weight files (of ``variant`` where it has them), built on the meta device: its
    config's declared sizes against its stored tensors (``ditq.checkpoint.component``), before diffusers or
    transformers allocates anything; a scheduler or tokenizer has none to check."""
    if issubclass(cls, torch.nn.Module) and _has_weight_files(component_dir):
        entries = component_entries(component_dir, variant)
        build_on_meta(cls, load_component_config(component_dir), component_dir, entries)


def load_component(
    model_dir: str | Path,
    component: str,
    device: str | torch.device = "auto",
    dtype: torch.dtype | str | None = None,
    variant: str | None = None,
    drop_unused: bool = True,
) -> Any:
    """One component of a diffusers directory; a ditq/compressed-tensors component comes back with QuantizedLinears.

    ``variant`` (``fp16``...) reads the component's variant files where it has them, as diffusers'
    ``from_pretrained(variant=...)`` does; None: the variant a ditq artifact records, else the default files.
    Quantized layers choose their kernel path and repack lazily, on the first
    forward (or through ``prepare_quantized``). With ``drop_unused``, the modules the artifact's manifest declares
    unused are neither loaded nor run (``ditq.runtime.unused``).
    """
    model_dir = Path(model_dir)
    device = resolve_device(device, option="device")
    dtype = resolve_dtype(dtype, device, option="dtype")
    check_sealed_reads(model_dir)
    return _load_component(model_dir, component, device, dtype, variant, drop_unused)


def _load_component(
    model_dir: Path,
    component: str,
    device: torch.device,
    dtype: torch.dtype,
    variant: str | None,
    drop_unused: bool,
) -> Any:
    """``load_component`` once ``model_dir`` was checked (``check_sealed_reads``) and the device and dtype resolved:
    ``load_pipeline`` checks the artifact once for all its components."""
    unused = sorted(recorded_unused(model_dir).get(component, {})) if drop_unused else []
    variant = variant if variant is not None else recorded_variant(model_dir)
    index = read_model_index(model_dir)
    library, class_name = component_class(index, component)
    cls = import_class(library, class_name, f"{model_dir}/model_index.json: {component}")
    component_dir = model_dir / component
    refuse_remote_code(component_dir, library)
    qconfig = is_quantized_component(model_dir, component)
    if qconfig is None:
        return _load_plain(component_dir, cls, torch.device(device), dtype, variant, unused)
    return _load_quantized(
        component_dir,
        cls,
        load_component_config(component_dir),
        qconfig,
        torch.device(device),
        dtype,
        variant,
        unused,
    )


def _has_weight_files(component_dir: Path) -> bool:
    return component_dir.is_dir() and any(is_weight_file(p.name) for p in component_dir.iterdir())


def prepare_quantized(
    module: torch.nn.Module,
    device: str | torch.device,
    dtype: torch.dtype,
    chooser: KernelChooser | None = None,
    repack: bool = True,
) -> int:
    """Choose every quantized layer's kernel path for ``device`` and repack once; returns the layer count.

    Layers whose buffers live elsewhere (offload) round-trip through ``device`` one at a time. Without
    ``repack``, the paths are chosen and each layer repacks on its first forward (``ditq.quantize_``: its stored
    tensors stay readable for ``ditq.save`` until then).
    """
    device = torch.device(device)
    layers = quantized_linears(module)
    chosen: dict[tuple[Any, ...], KernelPath | None] = {}  # one decision per geometry
    for layer in layers.values():
        key = (layer.scheme.name, layer.in_features, layer.out_features, layer.group_size)
        if key not in chosen:
            chosen[key] = chooser(layer, device, dtype) if chooser is not None else None
        layer.use_kernel(chosen[key], device, dtype)
        if repack:
            layer.prepare(device, dtype)
    return len(layers)


@contextmanager
def _without_diffusers_bars() -> Iterator[None]:
    """diffusers' "Loading pipeline components" bar, off for the block: it is drawn even into a log file."""
    from diffusers.utils import logging as diffusers_logging

    was_on = diffusers_logging.is_progress_bar_enabled()
    diffusers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            diffusers_logging.enable_progress_bar()


def load_components(model_dir: str | Path, load: ResolvedLoad, chooser: KernelChooser | None) -> Any:
    """A diffusers pipeline from a plain or ditq directory, or a hub id ``org/name[@revision]`` (resolved through
    the hub cache, ``ditq.checkpoint.hub.resolve_model``; ``local_files_only`` or ``HF_HUB_OFFLINE``: the cache
    only), its components loaded and placed as ``load`` says (the opener's part below the doctor and the model's
    own paths: ``ditq.pipeline.open.open_pipeline`` calls it, then installs attention, the KV cache and compilation).

    ``variant`` (``fp16``...) reads each component's variant files where it has them, else its default files,
    as diffusers' ``from_pretrained(variant=...)`` does; None: the variant a ditq artifact records (the
    components linked from its source keep the source's files), else the default files. A component with
    only other variants' files is an InputError naming them.

    With ``drop_unused`` (the default), the modules a ditq artifact's manifest declares unused (a text encoder's
    output head) are neither loaded onto the device nor run; the pipeline's ``ditq_unused`` maps each dropped
    ``component.module`` to the bytes it would have held.

    offload "none": every component loads on the device; "auto": components load on the host, then the most
    often run stay on the device as far as their weights fit the memory budget (default: the device's free
    memory) and the rest stream from pinned host memory (``ditq.runtime.offload.Placement``, kept as the
    pipeline's ``ditq_placement``); "model": components load on the host and move to the device one at a time
    when they run (diffusers' model CPU offload); "block": the transformer's blocks stream to the device one by
    one (diffusers' block-level group offload). Each quantized layer's kernel path is ``chooser``'s (None: the
    registry's first candidate). With ``fuse``, quantized projections that read one input (query/key/value,
    gate/up) run as one GEMM each (``ditq.runtime.fuse``; exact per output channel). Off by default: on an H200
    the fused fp8 loop ran 5 % slower than the separate layers (benchmarks/results/dit_bench_fused_eager_h200_7d332ce.json).
    """
    options = load.options
    offload, variant, drop_unused = options.offload, options.variant, options.drop_unused
    model_dir = resolve_model(model_dir, variant, options.local_files_only)
    index = read_model_index(model_dir)
    check_components_present(model_dir, index)
    classes = check_component_classes(model_dir, index)
    check_sealed_reads(model_dir)  # an artifact: only what its manifest lists is read
    cls = pipeline_class(index, model_dir)
    run_device, dtype = load.device, load.dtype
    load_device = run_device if offload == "none" else torch.device("cpu")
    recorded = recorded_variant(model_dir)
    variant = variant if variant is not None else recorded
    quantized: dict[str, Any] = {}
    plain_variants: set[str | None] = set()  # the variants the unquantized components load
    unused = recorded_unused(model_dir) if drop_unused else {}
    for name in component_names(index):
        if is_quantized_component(model_dir, name) is not None:
            quantized[name] = _load_component(model_dir, name, load_device, dtype, variant, drop_unused)
        elif _has_weight_files(model_dir / name):  # refused here in one line, not deep in diffusers
            refuse_unconfigured_quantized(model_dir / name, variant)
            chosen = variant_of(component_weight_files(model_dir / name, variant)[0].name)
            plain_variants.add(chosen)
            check_component_sizes(model_dir / name, classes[name], chosen)
    if variant is not None and variant not in plain_variants and variant != recorded:
        raise InputError(f"{model_dir}: no component has {variant} variant weights")
    with _without_diffusers_bars():
        try:
            # a Qwen-VL processor without torchvision: its image processor and tokenizer, no video processor
            processors = processors_without_video(model_dir, index, classes)
            pipeline = cls.from_pretrained(  # type: ignore[attr-defined]
                str(model_dir),
                dtype=dtype,
                variant=variant if variant in plain_variants else None,
                trust_remote_code=False,
                **quantized,
                **processors,
            )
        except ValueError as error:  # diffusers' refusal of an entry it cannot build (a bare string, a class
            # without from_pretrained): the model's fault, said in one line
            first = error_line(error) or type(error).__name__
            raise InputError(
                f"{model_dir / 'model_index.json'}: diffusers cannot build {cls.__name__} from it: {first}"
            ) from error
        except ImportError as error:  # a component whose class needs a library not installed (torchvision)
            raise missing_library(error, model_dir / "model_index.json") from error
    for name, modules in unused.items():
        component = pipeline.components.get(name)
        if (
            isinstance(component, torch.nn.Module) and name not in quantized
        ):  # quantized ones were built without
            drop_unused_modules(component, name, sorted(modules))  # on the host, before the component moves
    pipeline.ditq_unused = {f"{c}.{m}": size for c, modules in unused.items() for m, size in modules.items()}
    for name, component in pipeline.components.items():
        if isinstance(component, torch.nn.Module) and name not in quantized:
            component.to(load_device)
        if isinstance(component, torch.nn.Module):
            if options.fuse and name in quantized:
                fuse_projections(component)
            prepare_quantized(component, run_device, dtype, chooser)
    apply_offload(pipeline, offload, run_device, load.memory_budget_bytes)
    pipeline.ditq_quantized_components = tuple(
        quantized
    )  # the opener compiles a text encoder only if quantized
    return pipeline


def pipeline_summary(pipeline: Any) -> tuple[dict[str, dict[str, int]], dict[str, int]]:
    """(component -> scheme -> quantized Linear count, kernel path -> layer count) of a loaded pipeline."""
    schemes: dict[str, dict[str, int]] = {}
    kernels: dict[str, int] = {}
    for name, component in pipeline.components.items():
        if not isinstance(component, torch.nn.Module):
            continue
        for layer in quantized_linears(component).values():
            per = schemes.setdefault(name, {})
            per[layer.scheme.name] = per.get(layer.scheme.name, 0) + stored_layer_count(layer)
            kernel = layer.kernel.name if layer.kernel is not None else "unchosen"
            kernels[kernel] = kernels.get(kernel, 0) + stored_layer_count(layer)
    return schemes, kernels
