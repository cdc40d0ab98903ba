"""Loading diffusers directories whose components may be ditq (compressed-tensors) artifacts.

A component is quantized when its ``config.json`` carries a compressed-tensors
``quantization_config`` (per-component wrapper or plain form). Such a
component is built from its config with every parameter on the meta device,
each stored quantized Linear (a module with ``<prefix>.weight_scale``) is
swapped for the scheme's QuantizedLinear, and the stored tensors are read
one at a time and assigned in place: the source-precision weights of the
quantized layers never exist. Every other component loads the way diffusers
loads it.
"""

from __future__ import annotations

import importlib
import logging
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ditq.checkpoint.codecs import SCALE, config_groups, detect_codec, layer_scheme, quantized_layers
from ditq.checkpoint.layout import (
    component_class,
    component_names,
    load_component_config,
    quantization_config_of,
    read_model_index,
    weight_files,
)
from ditq.checkpoint.safetensors_io import TensorEntry, read_entry, read_header
from ditq.devices import resolve_device, resolve_offload
from ditq.errors import InputError
from ditq.kernels.registry import KernelPath
from ditq.runtime.modules import QuantizedLinear, quantized_linear_class, quantized_linears
from ditq.runtime.offload import apply_offload
from ditq.schemes import Scheme

__all__ = [
    "KernelChooser",
    "is_quantized_component",
    "load_component",
    "load_pipeline",
    "parameters_on_meta",
    "pipeline_class",
    "prepare_quantized",
]

log = logging.getLogger(__name__)

# Decides the kernel path of one layer (e.g. the doctor's verified choice); None = the registry's first candidate.
KernelChooser = Callable[[QuantizedLinear, torch.device, torch.dtype], "KernelPath | None"]


def _import(library: str, class_name: str, where: str) -> Any:
    try:
        module = importlib.import_module(library)
    except ImportError as error:
        raise InputError(f"{where}: cannot import library {library!r} ({error})") from error
    cls = getattr(module, class_name, None)
    if cls is None:
        raise InputError(f"{where}: library {library!r} has no class {class_name!r}")
    return cls


def pipeline_class(model_index: dict[str, Any], model_dir: Path) -> type:
    """The pipeline class named by ``_class_name``: from diffusers, else from a component's library or its parents."""
    name = model_index.get("_class_name")
    if not isinstance(name, str):
        raise InputError(f"{model_dir}/model_index.json: no _class_name")
    import diffusers

    if name in dir(diffusers):  # dir() lists the lazy names without importing every submodule
        return getattr(diffusers, name)
    for component in component_names(model_index):
        library, _ = component_class(model_index, component)
        parts = library.split(".")
        for depth in range(len(parts), 0, -1):
            try:
                module = importlib.import_module(".".join(parts[:depth]))
            except ImportError:
                continue
            if isinstance(getattr(module, name, None), type):
                return getattr(module, name)
    raise InputError(
        f"{model_dir}/model_index.json: pipeline class {name!r} not found in diffusers or the components' libraries"
    )


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


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside the block lives on the meta device; buffers stay real."""
    original = torch.nn.Module.register_parameter

    def register(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None:
            module._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=False)

    torch.nn.Module.register_parameter = register  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original  # type: ignore[method-assign]


def _build_empty(cls: Any, config: dict[str, Any], component_dir: Path) -> torch.nn.Module:
    """An instance from config with parameters on meta (diffusers ModelMixin or transformers PreTrainedModel)."""
    plain = {k: v for k, v in config.items() if k != "quantization_config"}
    with parameters_on_meta():
        if hasattr(cls, "config_class") and hasattr(cls, "_from_config"):  # transformers
            model = cls._from_config(cls.config_class.from_dict(plain))
        elif hasattr(cls, "from_config"):  # diffusers
            model = cls.from_config(plain)
        else:
            raise InputError(f"{component_dir}: cannot build {cls.__name__} from a config")
    if not isinstance(model, torch.nn.Module):
        raise InputError(f"{component_dir}: {cls.__name__} is not a torch module")
    return model.eval()


def _matches(entries: list[str], name: str, module: torch.nn.Module) -> bool:
    """compressed-tensors matching: ``re:`` regex (re.match) on the name, else the exact name or class name."""
    for entry in entries:
        if entry.startswith("re:"):
            if re.match(entry[3:], name):
                return True
        elif entry in (name, type(module).__name__):
            return True
    return False


def _swap_quantized_linears(
    model: torch.nn.Module,
    entries: dict[str, TensorEntry],
    qconfig: dict[str, Any],
    component_dir: Path,
    dtype: torch.dtype,
) -> dict[str, Scheme]:
    config_path = f"{component_dir}/config.json"
    groups = config_groups(qconfig, config_path)
    ignore = list(qconfig.get("ignore") or [])
    dtypes = {name: entry.dtype for name, entry in entries.items()}
    schemes: dict[str, Scheme] = {}
    for prefix in quantized_layers(entries):
        scale = entries[f"{prefix}.{SCALE}"]
        where = scale.path
        try:
            linear = model.get_submodule(prefix)
        except AttributeError:
            raise InputError(f"{where}: {prefix}.{SCALE} names no module of {type(model).__name__}") from None
        if not isinstance(linear, torch.nn.Linear):
            raise InputError(f"{where}: {prefix} is a {type(linear).__name__}, not a Linear")
        codec = detect_codec(prefix, dtypes, str(entries.get(f"{prefix}.weight", scale).path))
        group = next((g for g in groups if _matches(list(g.targets), prefix, linear)), None)
        if group is None or _matches(ignore, prefix, linear):
            why = "is listed in ignore" if group is not None else "is targeted by no config group"
            raise InputError(f"{config_path}: {prefix} is stored quantized but {why}")
        columns = scale.shape[1] if len(scale.shape) == 2 else 1
        scheme = layer_scheme(group, codec, linear.in_features, columns, f"{config_path}: {prefix}")
        replacement = quantized_linear_class(scheme.name)(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            group_size=scheme.group_size,
            device="meta",
            bias_dtype=dtype,
            scheme=scheme,
        )
        parent_name, _, attr = prefix.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, replacement)
        schemes[prefix] = scheme
    targets = [t for g in groups for t in g.targets]
    for name, module in model.named_modules():
        if (
            isinstance(module, torch.nn.Linear)
            and _matches(targets, name, module)
            and not _matches(ignore, name, module)
        ):
            raise InputError(
                f"{component_dir}: {name} is targeted by quantization_config and not ignored, "
                f"but the weight files hold no {name}.{SCALE} (incomplete artifact)"
            )
    return schemes


def _keep_float32(model: torch.nn.Module, name: str) -> bool:
    keep = getattr(model, "_keep_in_fp32_modules", None) or []
    return any(part in name.split(".") for part in keep)


def _assign(
    model: torch.nn.Module,
    name: str,
    tensor: torch.Tensor,
    entry: TensorEntry,
    device: torch.device,
    dtype: torch.dtype,
) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    placeholder = module._parameters.get(attr) if attr in module._parameters else module._buffers.get(attr)
    assert placeholder is not None
    if tuple(placeholder.shape) != tuple(tensor.shape):
        raise InputError(
            f"{entry.path}: tensor {name!r} has shape {tuple(tensor.shape)}, {type(model).__name__} expects {tuple(placeholder.shape)}"
        )
    stored_quantized = isinstance(module, QuantizedLinear) and attr in module.stored_names
    if stored_quantized and attr == SCALE and tensor.is_floating_point():
        tensor = tensor.to(torch.float32)
    elif stored_quantized and tensor.dtype != placeholder.dtype:
        raise InputError(
            f"{entry.path}: tensor {name!r} is {tensor.dtype}, {type(module).__name__} stores {placeholder.dtype}"
        )
    elif tensor.is_floating_point() and not stored_quantized:
        tensor = tensor.to(torch.float32 if _keep_float32(model, name) else dtype)
    tensor = tensor.to(device)
    if attr in module._parameters:
        module._parameters[attr] = torch.nn.Parameter(tensor, requires_grad=False)
    else:
        module._buffers[attr] = tensor


def _load_quantized(
    component_dir: Path,
    cls: Any,
    config: dict[str, Any],
    qconfig: dict[str, Any],
    device: torch.device,
    dtype: torch.dtype,
) -> torch.nn.Module:
    entries: dict[str, TensorEntry] = {}
    for path in weight_files(component_dir):
        entries.update(read_header(path).entries)
    model = _build_empty(cls, config, component_dir)
    schemes = _swap_quantized_linears(model, entries, qconfig, component_dir, dtype)
    expected = set(model.state_dict(keep_vars=True))
    for name in entries:
        if name not in expected:
            raise InputError(f"{entries[name].path}: tensor {name!r} has no place in {type(model).__name__}")
    for entry in sorted(entries.values(), key=lambda e: (str(e.path), e.begin)):
        _assign(model, entry.name, read_entry(entry), entry, device, dtype)
    tie_weights = getattr(model, "tie_weights", None)
    if callable(tie_weights):
        tie_weights()
    missing = sorted(n for n, t in model.state_dict(keep_vars=True).items() if t.is_meta)
    if missing:
        raise InputError(
            f"{component_dir}: tensor {missing[0]!r} is missing from the weight files ({len(missing)} missing; incomplete artifact)"
        )
    model.to(device)  # buffers built on the host (e.g. rotary tables)
    model.ditq_quantization_config = qconfig  # type: ignore[assignment]
    counts: dict[str, int] = {}
    for scheme in schemes.values():
        counts[scheme.name] = counts.get(scheme.name, 0) + 1
    log.info(
        "%s: %s quantized Linears (%s), loaded on %s",
        component_dir.name,
        len(schemes),
        ", ".join(f"{n} {s}" for s, n in sorted(counts.items())),
        device,
    )
    return model


def _load_plain(component_dir: Path, cls: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """A component the way diffusers loads it (models in ``dtype``; schedulers, tokenizers as they are)."""
    if isinstance(cls, type) and issubclass(cls, torch.nn.Module):
        return cls.from_pretrained(str(component_dir), dtype=dtype).to(device)  # type: ignore[attr-defined]
    return cls.from_pretrained(str(component_dir))


def load_component(
    model_dir: str | Path,
    component: str,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
) -> Any:
    """One component of a diffusers directory; a ditq/compressed-tensors component comes back with QuantizedLinears.

    Quantized layers choose their kernel path and repack lazily, on the first
    forward (or through ``prepare_quantized``).
    """
    model_dir = Path(model_dir)
    index = read_model_index(model_dir)
    library, class_name = component_class(index, component)
    cls = _import(library, class_name, f"{model_dir}/model_index.json: {component}")
    component_dir = model_dir / component
    qconfig = is_quantized_component(model_dir, component)
    if qconfig is None:
        return _load_plain(component_dir, cls, torch.device(device), dtype)
    return _load_quantized(
        component_dir, cls, load_component_config(component_dir), qconfig, torch.device(device), dtype
    )


def prepare_quantized(
    module: torch.nn.Module,
    device: str | torch.device,
    dtype: torch.dtype,
    chooser: KernelChooser | None = None,
) -> int:
    """Choose every quantized layer's kernel path for ``device`` and repack once; returns the layer count.

    Layers whose buffers live elsewhere (offload) round-trip through ``device`` one at a time.
    """
    device = torch.device(device)
    layers = quantized_linears(module)
    chosen: dict[tuple[Any, ...], KernelPath | None] = {}  # one decision per geometry
    for layer in layers.values():
        key = (layer.scheme.name, layer.in_features, layer.out_features, layer.group_size)
        if key not in chosen:
            chosen[key] = chooser(layer, device, dtype) if chooser is not None else None
        layer.use_kernel(chosen[key], device, dtype)
        layer.prepare(device, dtype)
    return len(layers)


def load_pipeline(
    model_dir: str | Path,
    device: str | torch.device = "cpu",
    offload: str = "none",
    dtype: torch.dtype = torch.bfloat16,
    chooser: KernelChooser | None = None,
) -> Any:
    """A diffusers pipeline from a plain or ditq directory, placed on ``device`` per ``offload``.

    offload "none": every component loads on ``device``; "model": components load on the host and move
    to ``device`` one at a time when they run (diffusers' model CPU offload); "block": the transformer's
    blocks stream to ``device`` one by one (diffusers' block-level group offload).
    """
    offload = resolve_offload(offload, option="offload")
    model_dir = Path(model_dir)
    index = read_model_index(model_dir)
    cls = pipeline_class(index, model_dir)
    run_device = resolve_device(device, option="device")
    load_device = run_device if offload == "none" else torch.device("cpu")
    quantized = {
        name: load_component(model_dir, name, load_device, dtype)
        for name in component_names(index)
        if is_quantized_component(model_dir, name) is not None
    }
    pipeline = cls.from_pretrained(str(model_dir), dtype=dtype, **quantized)  # type: ignore[attr-defined]
    for name, component in pipeline.components.items():
        if isinstance(component, torch.nn.Module) and name not in quantized:
            component.to(load_device)
        if isinstance(component, torch.nn.Module):
            prepare_quantized(component, run_device, dtype, chooser)
    apply_offload(pipeline, offload, run_device)
    return pipeline
