"""Building a component of a diffusers directory safely: trusted classes only, no code from the model, and the
sizes its config declares checked against its stored tensors before any real memory is allocated.

- **classes**: a component's ``[library, class]`` must name a class of diffusers, transformers or the bundled
  demo (``ditq.demo``); no other module is imported. A config that asks for code of its own (``auto_map`` in
  any ``*config.json`` of the folder), and a folder holding the file diffusers would import in place of the
  library (``<library>.py``), are refused: ditq never runs code shipped with a model, and never asks whether to.
- **declared sizes**: the class is built from its config on the meta device, counting parameters as they are
  registered, so a config that declares far more parameters than its files hold tensors (``num_layers: 200000``
  beside 2 stored blocks) stops within a few blocks. Then every parameter must have a stored tensor of its
  shape (by name, else, for checkpoints whose names differ from the module paths, by shape among the stored
  tensors no parameter name claims), and the tensors the build made that no file holds (rotary tables) may hold
  at most ``max(stored bytes, BUILT_TENSORS_FLOOR_BYTES)``. Rotary axes, which no stored tensor has the shape
  of, add up to no more than the widest stored tensor (they split one head). A quantized Linear's weight (a
  ``weight_scale`` is stored beside it) is its codec's to check.
- ``exact`` (a component ditq fills itself): every stored tensor must also have its place in the model.
"""

from __future__ import annotations

import importlib
import math
import re
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ditq.checkpoint.codecs import quantized_layers
from ditq.checkpoint.layout import MODEL_INDEX, component_class, component_names, read_json
from ditq.checkpoint.low_rank import LOW_RANK_NAMES
from ditq.checkpoint.safetensors_io import TensorEntry
from ditq.errors import DitqError, InputError

__all__ = [
    "BUILT_TENSORS_FLOOR_BYTES",
    "TRUSTED_LIBRARIES",
    "build_on_meta",
    "check_component_classes",
    "from_config",
    "import_class",
    "is_trusted_library",
    "refuse_remote_code",
]

# The packages whose classes ditq builds; a library is one of them or a module inside one.
TRUSTED_LIBRARIES = ("diffusers", "transformers", "ditq.demo")
# What the tensors a build makes besides the stored ones (rotary tables: Qwen-Image's are 4 MB) may always hold.
BUILT_TENSORS_FLOOR_BYTES = 256 * 1024**2
_DOTTED_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def is_trusted_library(library: str) -> bool:
    """Whether ``library`` is one of ``TRUSTED_LIBRARIES`` or a module inside one."""
    return any(library == root or library.startswith(f"{root}.") for root in TRUSTED_LIBRARIES)


def import_class(library: str, class_name: str, where: str) -> type:
    """The class ``library.class_name`` of a trusted library; an InputError naming ``where`` and the class for any
    other library (nothing of it is imported), a missing class, or a name that is not a class."""
    named = f"{library}.{class_name}"
    if not _DOTTED_NAME.match(library) or not is_trusted_library(library):
        trusted = ", ".join(TRUSTED_LIBRARIES)
        raise InputError(f"{where}: class {named} is not from {trusted}; ditq builds no other classes")
    if not class_name.isidentifier() or class_name.startswith("_"):
        raise InputError(f"{where}: {class_name!r} is not a class name")
    try:
        module = importlib.import_module(library)
    except ImportError as error:
        raise InputError(f"{where}: cannot import library {library!r} ({error})") from error
    cls = getattr(module, class_name, None)
    if cls is None:
        raise InputError(f"{where}: library {library!r} has no class {class_name!r}")
    if not isinstance(cls, type):
        raise InputError(f"{where}: {named} is not a class")
    return cls


def refuse_remote_code(component_dir: Path, library: str) -> None:
    """Refuse a component that asks for code of its own: an ``auto_map`` in any of its ``*config.json`` files
    (transformers would offer to run the module it names), or ``<library>.py`` beside them (diffusers would
    import it in place of the library)."""
    component_dir = Path(component_dir)
    shadow = component_dir / f"{library}.py"
    if shadow.exists() or shadow.is_symlink():
        raise InputError(
            f"{shadow}: a module shipped with the model in place of {library}; ditq runs no such code"
        )
    for path in sorted(component_dir.glob("*config.json")):
        auto_map = read_json(path).get("auto_map")
        if auto_map is not None:
            named = ", ".join(f"{v}" for v in auto_map.values()) if isinstance(auto_map, dict) else auto_map
            raise InputError(
                f"{path}: auto_map asks for the model's own code ({named}); ditq runs no code shipped with a model"
            )


@contextmanager
def _parameter_budget(stored: int, where: str) -> Iterator[None]:
    """Inside the block, making more than twice as many parameters as the ``stored`` tensors, and 64 more
    (registered, or deep-copied as ``torch.nn.TransformerEncoder`` clones its layers), is an InputError naming
    ``where``. Process-wide, as
    ``ditq.runtime.meta.parameters_on_meta``: no other thread may build modules meanwhile."""
    register_parameter, deepcopy = torch.nn.Module.register_parameter, torch.nn.Parameter.__deepcopy__
    made, limit = 0, 2 * stored + 64

    def count() -> None:
        nonlocal made
        made += 1
        if made > limit:
            raise InputError(
                f"{where}: declares more than {limit} parameter tensors, its weight files hold {stored} tensors "
                "(a count or size in it, layers or blocks, exceeds what the files hold)"
            )

    def register(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        if param is not None:
            count()
        register_parameter(module, name, param)

    def copy(param: torch.nn.Parameter, memo: dict[int, Any]) -> torch.nn.Parameter:
        count()
        return deepcopy(param, memo)

    torch.nn.Module.register_parameter = register  # type: ignore[method-assign,assignment]
    torch.nn.Parameter.__deepcopy__ = copy  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
        torch.nn.Parameter.__deepcopy__ = deepcopy  # type: ignore[method-assign]


def build_on_meta(
    cls: type,
    config: Mapping[str, Any],
    component_dir: Path,
    entries: Mapping[str, TensorEntry],
    exact: bool = False,
) -> torch.nn.Module:
    """``cls`` built from ``config`` on the meta device, its declared sizes checked against ``entries`` (the
    component's stored tensors; see the module docstring). Anything the class's own constructor raises for a
    field of the wrong kind is an InputError naming config.json."""
    where = f"{component_dir}/config.json"
    plain = {k: v for k, v in config.items() if k != "quantization_config"}
    fields = list(_fields(plain, ""))  # walked once, for both checks
    _check_numbers(fields, where)
    _check_rotary_axes(fields, entries, where)
    with torch.device("meta"), _parameter_budget(len(entries), where):
        model = from_config(cls, plain, where)
    tie_weights = getattr(model, "tie_weights", None)
    if callable(tie_weights):
        tie_weights()  # tied parameters are stored once
    _check_declared_sizes(model, entries, where, exact)
    return model.eval()


def from_config(cls: type, config: dict[str, Any], where: str) -> torch.nn.Module:
    """``cls`` (a diffusers or transformers model, or the demo's text encoder) built from a plain ``config``;
    whatever its constructor raises for a field of the wrong kind is an InputError naming ``where``."""
    try:
        if hasattr(cls, "config_class") and hasattr(cls, "_from_config"):  # transformers
            model = cls._from_config(cls.config_class.from_dict(config))
        elif hasattr(cls, "from_config"):  # diffusers, the demo's text encoder
            model = cls.from_config(config)
        else:
            raise InputError(f"{where}: cannot build {cls.__name__} from a config")
    except DitqError:
        raise
    except Exception as error:  # third-party constructors fed a file's fields raise what they raise
        detail = " ".join(f"{type(error).__name__}: {error}".split())
        raise InputError(f"{where}: cannot build a {cls.__name__} from it ({detail[:300]})") from error
    if not isinstance(model, torch.nn.Module):
        raise InputError(f"{where}: {cls.__name__} is not a torch module")
    return model


def _check_numbers(fields: Sequence[tuple[str, Any]], where: str) -> None:
    """No number of a model's config is NaN or infinite (JSON has neither; Python's reader takes them, and an
    ``eps`` of NaN draws a blank picture), and no count (a ``num_*`` field: layers, heads, blocks) is negative,
    which a constructor's ``range`` takes for none. ``fields``: the config's, as ``_fields`` gives them."""
    for key, value in fields:
        values: list[Any] = []
        nested = [value]
        while nested:  # the numbers of a list, at any depth
            item = nested.pop()
            if isinstance(item, list):
                nested.extend(item)
            else:
                values.append(item)
        shown = f"{value!r:.80}"  # a long list is cut: the line names the field
        if any(isinstance(v, float) and not math.isfinite(v) for v in values):
            raise InputError(f"{where}: {key} is {shown}; a config's numbers are finite")
        count = key.rsplit(".", 1)[-1].startswith("num_")
        if count and any(type(v) is int and v < 0 for v in values):
            raise InputError(f"{where}: {key} is {shown}; a count is never negative")


def _check_rotary_axes(
    fields: Sequence[tuple[str, Any]], entries: Mapping[str, TensorEntry], where: str
) -> None:
    """Rotary axes (``axes_dims_rope``, ``rope_scaling.mrope_section``...: a list of whole numbers under a key
    that says rope or axes) split one attention head, so together they are no wider than the widest stored
    tensor; no stored tensor has their shape, and Flux computes its tables from them at every forward."""
    widest = max((max(e.shape, default=0) for e in entries.values()), default=0)
    for key, value in fields:
        named = "rope" in key.lower() or "axes" in key.lower()
        axes = named and isinstance(value, list) and bool(value) and all(type(v) is int for v in value)
        if axes and sum(value) > widest:
            raise InputError(
                f"{where}: {key} {value} adds up to {sum(value)}, wider than any stored tensor ({widest})"
            )


def _fields(config: Mapping[str, Any], prefix: str) -> Iterator[tuple[str, Any]]:
    """Every field of a config, nested objects' too (``rope_scaling.mrope_section``), objects inside lists at any
    depth named by their index (``layers[1].eps``)."""
    for key, value in config.items():
        yield f"{prefix}{key}", value
        yield from _nested(value, f"{prefix}{key}")


def _nested(value: Any, name: str) -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        yield from _fields(value, f"{name}.")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _nested(item, f"{name}[{index}]")


def _check_declared_sizes(
    model: torch.nn.Module, entries: Mapping[str, TensorEntry], where: str, exact: bool
) -> None:
    name = type(model).__name__
    state = model.state_dict(keep_vars=True)
    parameters = {id(p) for p in model.parameters()}
    layers = quantized_layers(entries)
    by_codec = {f"{prefix}.{local}" for prefix, locals_ in layers.items() for local in locals_}
    by_codec |= {f"{prefix}.{local}" for prefix in layers for local in LOW_RANK_NAMES}  # checked at the swap
    claimed: dict[int, list[str]] = {}  # one tensor (tied ones share it) -> its state-dict names
    for key, tensor in state.items():
        claimed.setdefault(id(tensor), []).append(key)
    unclaimed = Counter(tuple(e.shape) for n, e in entries.items() if n not in state and n not in by_codec)
    for keys in claimed.values():
        tensor = state[keys[0]]
        shape = tuple(tensor.shape)
        if any(k.endswith(".weight") and k[: -len(".weight")] in layers for k in keys):
            continue  # a quantized Linear's weight: its codec checks what is stored for it
        stored = next((k for k in keys if k in entries), None)
        if stored is not None:
            if entries[stored].shape != shape:
                raise InputError(
                    f"{entries[stored].path}: tensor {stored!r} has shape {list(entries[stored].shape)}, "
                    f"{where} declares {list(shape)}"
                )
        elif id(tensor) not in parameters:
            continue  # a buffer no file stores: bounded below with the other built tensors
        elif not exact and unclaimed[shape] > 0:
            unclaimed[shape] -= 1  # stored under another name (a checkpoint of older module paths)
        else:
            raise InputError(
                f"{where}: tensor {keys[0]!r} is missing from the weight files ({name} declares it, of shape "
                f"{list(shape)})"
            )
    if exact:
        for key, entry in entries.items():
            if key not in state and key not in by_codec:
                raise InputError(f"{entry.path}: tensor {key!r} has no place in {name}")
    stored_bytes = sum(e.nbytes for e in entries.values())
    built_bytes = sum(t.numel() * t.element_size() for t in _built_tensors(model, set(entries)))
    if built_bytes > max(stored_bytes, BUILT_TENSORS_FLOOR_BYTES):
        raise InputError(
            f"{where}: building {name} would allocate {built_bytes} bytes of tensors its weight files do not "
            f"hold (rotary or position tables), over the {max(stored_bytes, BUILT_TENSORS_FLOOR_BYTES)} allowed "
            "(a size in it exceeds what the files hold)"
        )


def _built_tensors(model: torch.nn.Module, stored: set[str]) -> Iterator[torch.Tensor]:
    """The tensors a build made that no file holds: buffers not stored, and tensors kept as plain attributes
    (a rotary table that must stay complex is no buffer), each once."""
    seen: set[int] = set()
    for prefix, module in model.named_modules():
        found = [(f"{prefix}.{n}".lstrip("."), b) for n, b in module._buffers.items() if b is not None]
        for value in vars(module).values():
            items = value if isinstance(value, (list, tuple)) else [value]
            found += [("", t) for t in items if isinstance(t, torch.Tensor)]
        for key, tensor in found:
            if id(tensor) not in seen and key not in stored:
                seen.add(id(tensor))
                yield tensor


def check_component_classes(model_dir: Path, model_index: dict[str, Any]) -> dict[str, type]:
    """Every component's class (trusted libraries only) and no component asking for code of its own; component
    -> class. Run before any component of ``model_dir`` is built or handed to diffusers."""
    classes: dict[str, type] = {}
    for name in component_names(model_index):
        library, class_name = component_class(model_index, name)
        classes[name] = import_class(library, class_name, f"{Path(model_dir) / MODEL_INDEX}: {name}")
        if (Path(model_dir) / name).is_dir():
            refuse_remote_code(Path(model_dir) / name, library)
    return classes
