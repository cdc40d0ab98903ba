"""Named LoRA adapters on a pipeline: read from their files, loaded by diffusers' own calls, chosen per call.

``NAME=PATH[:SCALE]`` (``ditq serve --lora``) names one adapter: PATH is a ``.safetensors`` file, or a folder that
holds one (diffusers' ``pytorch_lora_weights.safetensors``, peft's ``adapter_model.safetensors`` beside its
``adapter_config.json``, or a single ``*.safetensors``); SCALE (default 1) is its weight. Only those files are read:
the path never reaches a hub lookup.

A file whose keys carry the pipeline's component prefixes (``transformer.…``, as diffusers' ``save_lora_weights``
writes) loads through the pipeline's ``load_lora_weights`` where it is a LoRA loader, which converts the model
family's other key formats too; any other file (peft's keys, bare or under ``base_model.model.``) loads into the
transformer by its ``load_lora_adapter``. An adapter none of whose weights found a layer, or only part of them, is
refused in one line naming it: an adapter applied in part is a silent error.

``LoraAdapters.activate`` makes one call's choice the active set (``set_adapters``), or turns every adapter off for
none: each call states its whole choice, so nothing of one call's choice outlives it.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ditq.errors import InputError, error_line

__all__ = [
    "MAX_LORA_SCALE",
    "LoadedLora",
    "LoraAdapters",
    "LoraSpec",
    "check_lora_scale",
    "load_lora_adapters",
    "parse_lora_specs",
    "refuse_beside_lora",
]

MAX_LORA_SCALE = 10.0  # |scale| at most: past it an adapter's update swamps the weights it adjusts
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # peft keeps adapters in ModuleDicts: no '.' in a name
_FOLDER_FILES = ("pytorch_lora_weights.safetensors", "adapter_model.safetensors")
_PEFT_PREFIX = "base_model.model."
_METADATA_KEY = "lora_adapter_metadata"  # where diffusers' save_lora_weights keeps each adapter's LoraConfig
# adapter_config.json's fields that shape the LoraConfig diffusers builds (the rest describe how it was trained)
_CONFIG_FIELDS = (
    "r",
    "lora_alpha",
    "target_modules",
    "rank_pattern",
    "alpha_pattern",
    "use_rslora",
    "use_dora",
)


def check_lora_scale(scale: float, where: str, field: str | None = None) -> float:
    """``scale`` when it is finite and within ``MAX_LORA_SCALE`` of zero, else an InputError naming ``where``."""
    if not math.isfinite(scale) or abs(scale) > MAX_LORA_SCALE:
        raise InputError(
            f"{where}: scale {scale:g} is not a finite number in [-{MAX_LORA_SCALE:g}, {MAX_LORA_SCALE:g}]",
            field=field,
        )
    return scale


@dataclass(frozen=True)
class LoraSpec:
    """One adapter as the command line names it: ``NAME=PATH[:SCALE]``."""

    name: str
    path: Path
    scale: float = 1.0

    @classmethod
    def parse(cls, text: str, flag: str = "--lora") -> LoraSpec:
        """``NAME=PATH[:SCALE]`` (``of_path`` reads PATH[:SCALE])."""
        name, sep, rest = text.partition("=")
        if not sep or not rest:
            raise InputError(f"{flag} {text!r}: expected NAME=PATH[:SCALE]")
        if _NAME.fullmatch(name) is None:
            raise InputError(f"{flag} {text!r}: the name must be 1 to 64 letters, digits, '_' or '-'")
        if hasattr(torch.nn.ModuleDict, name):  # peft keeps each adapter under its name in a ModuleDict
            raise InputError(
                f"{flag} {text!r}: the name {name!r} is one of torch's Module attributes; choose another"
            )
        return cls.of_path(rest, name, flag, shown=text)

    @classmethod
    def of_path(cls, text: str, name: str, flag: str = "--lora", shown: str | None = None) -> LoraSpec:
        """``PATH[:SCALE]`` as adapter ``name``; a SCALE is the text after the last ':' where it reads as a number (a
        path may hold ':' too). The file is checked to exist here, its contents when it loads. Errors quote
        ``shown`` (default: ``text``) after ``flag``."""
        path, scale = text, 1.0
        head, colon, tail = text.rpartition(":")
        if colon and head:
            with contextlib.suppress(ValueError):  # not a number: part of the path
                scale, path = float(tail), head
        check_lora_scale(scale, f"{flag} {shown or text}")
        spec = cls(name, Path(path), scale)
        spec.weight_file()  # missing or unreadable: refused before anything loads
        return spec

    @property
    def argument(self) -> str:
        """``NAME=PATH:SCALE``: ``ditq serve --lora``'s value for this adapter."""
        return f"{self.name}={self.path}:{self.scale!r}"

    def weight_file(self) -> Path:
        """The one ``.safetensors`` file PATH names."""
        where = f"--lora {self.name}={self.path}"
        if self.path.is_file():
            if self.path.suffix != ".safetensors":
                raise InputError(f"{where}: not a .safetensors file")
            return self.path
        if not self.path.is_dir():
            raise InputError(f"{where}: no such file or folder")
        named = [self.path / name for name in _FOLDER_FILES if (self.path / name).is_file()]
        found = named or sorted(self.path.glob("*.safetensors"))
        if len(found) != 1:
            what = "no .safetensors file" if not found else f"{len(found)} .safetensors files and none named"
            raise InputError(f"{where}: the folder holds {what} ({' or '.join(_FOLDER_FILES)})")
        return found[0]


@dataclass(frozen=True)
class LoadedLora:
    """An adapter in place: its start-up scale, and the layers and bytes its weights take."""

    name: str
    scale: float
    layers: int
    parameter_bytes: int

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "scale": self.scale,
            "layers": self.layers,
            "parameter_bytes": self.parameter_bytes,
        }


class LoraAdapters:
    """The adapters loaded on one pipeline, and the choice each call makes among them."""

    def __init__(self, pipeline: Any, loaded: Sequence[LoadedLora]) -> None:
        self.pipeline = pipeline
        self.loaded = {lora.name: lora for lora in loaded}
        # the pipeline's own calls where it is a LoRA loader (they reach its text encoders too), else the transformer's
        self._owner = pipeline if hasattr(pipeline, "load_lora_weights") else pipeline.transformer

    @property
    def defaults(self) -> tuple[tuple[str, float], ...]:
        """A call that chooses nothing: every adapter at its start-up scale."""
        return tuple((lora.name, lora.scale) for lora in self.loaded.values())

    @property
    def parameter_bytes(self) -> int:
        return sum(lora.parameter_bytes for lora in self.loaded.values())

    def resolve(self, choice: Sequence[tuple[str, float | None]] | None) -> tuple[tuple[str, float], ...]:
        """A call's choice, checked: None is ``defaults``; a scale left out is the adapter's start-up scale. An
        unknown name, a name twice or a scale out of range is an InputError naming the field ``lora``."""
        if choice is None:
            return self.defaults
        resolved: dict[str, float] = {}
        for name, scale in choice:
            if name not in self.loaded:
                known = ", ".join(self.loaded) or "none: the server was started without --lora"
                raise InputError(f"lora: unknown adapter '{name[:64]}' (loaded: {known})", field="lora")
            if name in resolved:
                raise InputError(f"lora: adapter '{name}' given twice", field="lora")
            given = self.loaded[name].scale if scale is None else scale
            resolved[name] = check_lora_scale(given, f"lora: adapter '{name}'", field="lora")
        return tuple(resolved.items())

    def activate(self, choice: Sequence[tuple[str, float]]) -> None:
        """Make ``choice`` (resolved) the active set: the adapters it names at its scales, the others off."""
        if not choice:
            self._owner.disable_lora()
            return
        self._owner.enable_lora()
        names, weights = zip(*choice, strict=True)
        self._owner.set_adapters(list(names), list(weights))

    def to_json(self) -> dict[str, Any]:
        """/health's view: each adapter and the bytes they take together (none of their paths)."""
        return {
            "adapters": [lora.to_json() for lora in self.loaded.values()],
            "parameter_bytes": self.parameter_bytes,
        }


def parse_lora_specs(texts: Sequence[str], flag: str = "--lora") -> tuple[LoraSpec, ...]:
    """Each ``NAME=PATH[:SCALE]`` of a repeated flag; a name given twice is an InputError naming it."""
    specs = tuple(LoraSpec.parse(text, flag) for text in texts)
    names = [spec.name for spec in specs]
    twice = next((name for name in names if names.count(name) > 1), None)
    if twice is not None:
        raise InputError(f"{flag}: the name {twice!r} is given twice")
    return specs


def refuse_beside_lora(verb: str, offload: str, compile: str | None, *beside: tuple[str, bool]) -> None:
    """``--lora`` beside what a command does not run it with yet, in one line (``not {verb} beside ...``): the flags
    of ``beside`` that are given (a command's own: ``--parallel``, whose every rank would need the adapters), an
    offload other than ``none`` (its placement is sized and its weights placed before the adapters exist) and
    compilation (the blocks are traced before they load)."""
    given = [
        flag
        for flag, on in (
            *beside,
            (f"--offload {offload}", offload != "none"),
            ("--compile", compile is not None),
        )
        if on
    ]
    if given:
        raise InputError(f"--lora: not {verb} beside {', '.join(given)} yet; drop one or the other")


def _read(spec: LoraSpec) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """The file's tensors (peft's ``base_model.model.`` taken off) and the LoraConfig fields it records: diffusers'
    metadata in its header, else peft's ``adapter_config.json`` beside it."""
    from safetensors import SafetensorError, safe_open

    path = spec.weight_file()
    try:
        with safe_open(str(path), framework="pt") as weights:
            header = weights.metadata() or {}
            state = {key.removeprefix(_PEFT_PREFIX): weights.get_tensor(key) for key in weights.keys()}  # noqa: SIM118
    except (SafetensorError, OSError) as error:
        raise InputError(
            f"--lora {spec.name}={spec.path}: {path.name} is not a safetensors file ({error})"
        ) from None
    if not state:
        raise InputError(f"--lora {spec.name}={spec.path}: {path.name} holds no tensors")
    metadata: dict[str, Any] | None = None
    config = path.parent / "adapter_config.json"
    try:
        if _METADATA_KEY in header:
            metadata = json.loads(header[_METADATA_KEY])
        elif path.name == "adapter_model.safetensors" and config.is_file():
            recorded = json.loads(config.read_text())
            metadata = {key: recorded[key] for key in _CONFIG_FIELDS if recorded.get(key) is not None}
    except (ValueError, TypeError, KeyError) as error:
        raise InputError(f"--lora {spec.name}={spec.path}: its LoRA config does not read ({error})") from None
    return state, metadata


def _adapter_parameters(pipeline: Any, name: str) -> tuple[int, int, int]:
    """(layers, tensors, bytes) of adapter ``name`` over every component of ``pipeline``."""
    layers: set[str] = set()
    tensors = size = 0
    marker = re.compile(
        rf"\.lora_(?:A|B|embedding_A|embedding_B|magnitude_vector)\.{re.escape(name)}(?:\.|$)"
    )
    for component_name, component in pipeline.components.items():
        if not isinstance(component, torch.nn.Module):
            continue
        for parameter_name, parameter in component.named_parameters():
            found = marker.search(parameter_name)
            if found is not None:
                layers.add(f"{component_name}.{parameter_name[: found.start()]}")
                tensors += 1
                size += parameter.numel() * parameter.element_size()
    return len(layers), tensors, size


def _load_one(pipeline: Any, spec: LoraSpec) -> LoadedLora:
    state, metadata = _read(spec)
    where = f"--lora {spec.name}={spec.path}"
    components = {key.partition(".")[0] for key in state}
    transformer: Any = getattr(pipeline, "transformer", None)
    if not hasattr(transformer, "load_lora_adapter"):
        raise InputError(f"{where}: {type(pipeline).__name__} has no transformer that takes LoRA adapters")
    try:
        with warnings.catch_warnings():
            # peft's note that the model holds an adapter already: a second one is what --lora asked for
            warnings.filterwarnings("ignore", "Already found a `peft_config`", UserWarning)
            if hasattr(pipeline, "load_lora_weights") and components <= set(pipeline.components):
                # diffusers reads the file itself (its header's metadata too), from this path only
                path = spec.weight_file()
                pipeline.load_lora_weights(
                    str(path.parent), weight_name=path.name, adapter_name=spec.name, local_files_only=True
                )
            else:
                prefix = "transformer" if components == {"transformer"} else None
                transformer.load_lora_adapter(state, adapter_name=spec.name, prefix=prefix, metadata=metadata)
    except InputError as error:  # ditq's LoRA layer's refusal (DoRA, a LoRA bias on a quantized Linear)
        raise InputError(f"{where}: {error}") from None
    except (ValueError, KeyError, RuntimeError) as error:  # peft's and diffusers' (no layer matched, say)
        raise InputError(
            f"{where}: it does not load onto the served pipeline: {error_line(error)[:300]}"
        ) from None
    layers, tensors, size = _adapter_parameters(pipeline, spec.name)
    expected = sum(1 for key in state if "lora" in key and not key.endswith("alpha"))
    if layers == 0:
        raise InputError(
            f"{where}: none of its {len(state)} tensors' names match a layer of the served pipeline"
        )
    if tensors < expected:
        raise InputError(
            f"{where}: {expected - tensors} of its {expected} LoRA weights match no layer of the served pipeline"
        )
    return LoadedLora(spec.name, spec.scale, layers, size)


def load_lora_adapters(pipeline: Any, specs: Sequence[LoraSpec]) -> LoraAdapters:
    """Every adapter of ``specs`` loaded onto ``pipeline`` (ditq's quantized Linears too: ``ditq.runtime.lora``),
    all of them active at their scales. A name given twice, a file that does not read or an adapter that fits no
    layer is an InputError naming its ``--lora``."""
    from ditq.runtime.lora import register_with_peft

    names = [spec.name for spec in specs]
    twice = next((name for name in names if names.count(name) > 1), None)
    if twice is not None:
        raise InputError(f"--lora: the name {twice!r} is given twice")
    if not register_with_peft():
        raise InputError("--lora: LoRA adapters need peft (pip install 'ditq[lora]')")
    adapters = LoraAdapters(pipeline, [_load_one(pipeline, spec) for spec in specs])
    adapters.activate(adapters.defaults)
    return adapters
