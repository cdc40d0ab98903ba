"""Which Linear weights of a component get quantized, derived from the model's own structure, and why not the rest.

The component's class (from ``model_index.json``) is built on the meta device
from its ``config.json`` (no weights read); its ``named_modules`` are walked:

- **block lists** are the outermost ``ModuleList``s whose items all share one
  class and hold Linears (``transformer_blocks``, ``single_transformer_blocks``,
  ``blocks``, a text encoder's ``layers``...). Their Linears are the default
  targets.
- every other Linear is a **boundary** layer (patch/text/timestep embedders,
  final norm and projection), and so is a Linear inside a block that sits
  under a normalization or modulation module (adaLN, ``img_mod``...).
- a Linear whose parent module's forward reads its ``.weight`` directly (T5's
  feed-forward casts its input to ``self.wo.weight.dtype``) is kept
  (**reads .weight**): a quantized layer stores no weight of the source dtype.
- the **shape guard** keeps Linears whose in or out features are not a
  multiple of 16 (no 8-bit kernel takes them) or below ``min_features``.
- ``--targets`` regexes replace the block rule, ``--ignore`` regexes remove
  matches (**user choice**). Regexes are searched in the tensor-name prefix.
- with ``embeddings`` (the 4-bit schemes: ``Scheme.embedding``), the model's token embedding (transformers'
  ``get_input_embeddings()``, a ``torch.nn.Embedding``) is a target too, its rows read as a Linear's output
  channels (out = vocabulary, in = hidden size), as compressed-tensors quantizes an Embedding's weight
  (``COMPRESSIBLE_MODULE_TYPES``); it is kept where another module holds its weight too (**shared**: T5's
  ``encoder.embed_tokens``, a tied output head) or where a forward reads its ``.weight``.
- every other module that stores a ``weight`` (norms, convolutions,
  embeddings) is listed too (**not a Linear**), as llm-compressor lists them:
  compressed-tensors' file-level tools treat each ``<prefix>.weight`` that
  ``ignore`` does not name as quantized when the targets say ``Linear``.

Names are the checkpoint's tensor prefixes (``<prefix>.weight``), matched to
module names directly or, for models whose checkpoint keys differ from their
module paths, by the longest unique suffix.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ditq.checkpoint.component import build_on_meta, import_class, refuse_remote_code
from ditq.checkpoint.layout import read_json
from ditq.checkpoint.patterns import compile_pattern
from ditq.checkpoint.safetensors_io import TensorEntry
from ditq.errors import InputError
from ditq.quantization.defaults import AUTO_MIN_SHARE
from ditq.schemes import SCHEMES, Scheme

__all__ = [
    "ALIGNMENT",
    "AUTO_MIN_SHARE",
    "MIN_FEATURES",
    "LinearLayer",
    "TargetPlan",
    "block_lists",
    "build_meta_model",
    "embedding_targeted",
    "linear_at",
    "output_heads",
    "plan_targets",
    "reads_logits",
    "token_embedding",
]

ALIGNMENT = 16  # in and out features must be multiples of this for every 8-bit kernel path
MIN_FEATURES = 32  # smaller Linears gain nothing from 8 bits
_MODULATION_NAME = re.compile(r"(^|_)(mod|modulation|adaln)(_|\d|$)|norm", re.IGNORECASE)
_MODULATION_CLASS = re.compile(r"norm|modulation", re.IGNORECASE)


@dataclass(frozen=True)
class LinearLayer:
    name: str  # tensor-name prefix in the checkpoint
    in_features: int
    out_features: int


@dataclass
class TargetPlan:
    """The outcome for every Linear of one component: quantize it, or keep it and say why."""

    component: str
    targets: dict[str, LinearLayer] = field(default_factory=dict)
    ignored: dict[str, str] = field(default_factory=dict)  # prefix -> reason
    block_lists: list[str] = field(default_factory=list)
    embeddings: set[str] = field(default_factory=set)  # the targets that are token embeddings, not Linears

    def uniform(self, scheme: Scheme) -> dict[str, Scheme]:
        """Target prefix -> ``scheme`` as it fits that layer (``Scheme.fitted``: 4-bit groups that do not divide a
        layer's in_features become per-channel scales); a token embedding gets ``scheme.embedding``."""
        if self.embeddings and scheme.embedding is None:
            raise InputError(
                f"{self.component}: scheme {scheme.name} keeps token embeddings in source precision"
            )
        return {
            prefix: SCHEMES[scheme.embedding]
            if prefix in self.embeddings and scheme.embedding
            else scheme.fitted(layer.in_features)
            for prefix, layer in self.targets.items()
        }


def build_meta_model(
    component_dir: Path,
    library: str,
    class_name: str,
    entries: Mapping[str, TensorEntry],
    exact: bool = False,
) -> torch.nn.Module:
    """The component's model class, instantiated from its config on the meta device (no memory, no weights),
    its declared sizes checked against ``entries`` (its stored tensors), as ``ditq.checkpoint.component`` builds
    every component: trusted classes only, no code from the model.

    A config the class cannot be built from (a field of the wrong type, a negative width, sizes its files do not
    hold) is an InputError naming config.json: the class's own constructor is what checks its fields.
    """
    component_dir = Path(component_dir)
    cls = import_class(library, class_name, f"{component_dir}/config.json")
    refuse_remote_code(component_dir, library)
    config = read_json(component_dir / "config.json")
    return build_on_meta(cls, config, component_dir, entries, exact)


def block_lists(model: torch.nn.Module) -> list[str]:
    """Outermost ModuleLists of one repeated class that contain Linear layers."""
    found: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) == 0:
            continue
        if any(name.startswith(f"{outer}.") for outer in found):
            continue
        if len({type(item) for item in module}) != 1:
            continue
        if any(isinstance(m, torch.nn.Linear) for m in module.modules()):
            found.append(name)
    return found


def _boundary_reason(model: torch.nn.Module, module_name: str, blocks: list[str]) -> str | None:
    outer = next((b for b in blocks if module_name.startswith(f"{b}.")), None)
    if outer is None:
        return "boundary: outside the repeated blocks (embedder, final norm or projection)"
    # Path inside the block item, e.g. "norm1.linear" under "transformer_blocks.3".
    inner = module_name[len(outer) + 1 :].split(".")[1:]
    parent: torch.nn.Module = model.get_submodule(f"{outer}.{module_name[len(outer) + 1 :].split('.')[0]}")
    for segment in inner[:-1]:
        parent = parent.get_submodule(segment)
        if _MODULATION_NAME.search(segment) or _MODULATION_CLASS.search(type(parent).__name__):
            return "boundary: modulation/adaLN inside a block"
    return None


def _shape_reason(layer: LinearLayer, min_features: int, group_size: int | None) -> str | None:
    for label, size in (("in_features", layer.in_features), ("out_features", layer.out_features)):
        if size % ALIGNMENT:
            return f"shape guard: {label} {size} is not a multiple of {ALIGNMENT}"
    if min(layer.in_features, layer.out_features) < min_features:
        return f"shape guard: too small to gain ({layer.out_features}x{layer.in_features}, minimum {min_features})"
    if group_size is not None and layer.in_features % group_size:
        return f"shape guard: in_features {layer.in_features} is not a multiple of group size {group_size}"
    return None


_FORWARD_SOURCES: dict[type, str] = {}


def _forward_source(cls: type) -> str:
    if cls not in _FORWARD_SOURCES:
        try:
            _FORWARD_SOURCES[cls] = inspect.getsource(cls.forward)  # type: ignore[attr-defined]
        except (AttributeError, OSError, TypeError):  # no forward, or no source (built in, generated)
            _FORWARD_SOURCES[cls] = ""
    return _FORWARD_SOURCES[cls]


def _weight_read_reason(model: torch.nn.Module, module_name: str) -> str | None:
    """Why a Linear must keep its ``weight``: its parent's forward reads ``self.<name>.weight``, or None."""
    parent_name, _, attr = module_name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    if re.search(rf"self\.{re.escape(attr)}\.weight\b", _forward_source(type(parent))):
        return f"reads .weight: {type(parent).__name__} reads self.{attr}.weight directly, which a quantized layer does not hold"
    return None


def _checkpoint_prefix(module_name: str, weights: dict[str, tuple[int, ...]]) -> str | None:
    """The checkpoint prefix holding ``<module_name>.weight``: exact, else the longest unique suffix match."""
    if f"{module_name}.weight" in weights:
        return module_name
    parts = module_name.split(".")
    for start in range(1, len(parts)):
        suffix = ".".join(parts[start:]) + ".weight"
        hits = [k for k in weights if k == suffix or k.endswith(f".{suffix}")]
        if len(hits) == 1:
            return hits[0][: -len(".weight")]
        if len(hits) > 1:
            return None
    return None


def _module_class(model: torch.nn.Module, prefix: str) -> str:
    """The class name of the module a checkpoint prefix names ("module" where the names do not line up)."""
    try:
        return type(model.get_submodule(prefix)).__name__
    except AttributeError:
        return "module"


def _compile(patterns: Iterable[str], flag: str) -> list[re.Pattern[str]]:
    return [compile_pattern(pattern, flag) for pattern in patterns]


def linear_at(module: torch.nn.Module, prefix: str) -> torch.nn.Linear:
    """The ``torch.nn.Linear`` at ``prefix`` in ``module``; anything else there is an InputError naming it."""
    layer = module.get_submodule(prefix)
    if not isinstance(layer, torch.nn.Linear):
        raise InputError(f"{prefix}: not a torch.nn.Linear ({type(layer).__name__})")
    return layer


def token_embedding(
    model: torch.nn.Module, weight_shapes: dict[str, tuple[int, ...]], min_features: int = MIN_FEATURES
) -> tuple[str, LinearLayer | str] | None:
    """The model's stored token embedding (``get_input_embeddings()``, a ``torch.nn.Embedding``) as (its checkpoint
    prefix, its rows as a layer: out = num_embeddings, in = embedding_dim), or (prefix, why it stays in source
    precision); None where the model has none, or none of its own in the checkpoint."""
    get = getattr(model, "get_input_embeddings", None)
    try:
        embedding = get() if callable(get) else None
    except (AttributeError, NotImplementedError):  # a class that declares the method but has no embedding
        return None
    if not isinstance(embedding, torch.nn.Embedding) or embedding.max_norm is not None:
        return None  # (with max_norm, a lookup rewrites the rows it reads: they must stay a floating weight)
    names = [name for name, module in model.named_modules(remove_duplicate=False) if module is embedding]
    names += [  # modules of their own that hold the same weight (tied: T5's encoder.embed_tokens, an output head)
        name
        for name, module in model.named_modules()
        if module is not embedding and any(p is embedding.weight for p in module.parameters(recurse=False))
    ]
    prefix = _checkpoint_prefix(names[0], weight_shapes) if names else None
    if prefix is None:
        return None
    if len(names) > 1:
        return prefix, f"shared: its weight is also {', '.join(names[1:])}'s"
    layer = LinearLayer(prefix, embedding.embedding_dim, embedding.num_embeddings)
    reason = _weight_read_reason(model, names[0]) or _shape_reason(layer, min_features, None)
    return prefix, layer if reason is None else reason


def embedding_targeted(scheme: Scheme | None, low_rank: int) -> bool:
    """Whether the token embedding is a target (``plan_targets``' ``embeddings``): under a uniform scheme that names
    one for it (``Scheme.embedding``: the 4-bit schemes), never beside a low-rank branch, which only Linears carry,
    nor under a plan (``scheme`` None), which names every layer's scheme itself."""
    return scheme is not None and scheme.embedding is not None and not low_rank


def plan_targets(
    model: torch.nn.Module,
    component: str,
    weight_shapes: dict[str, tuple[int, ...]],
    targets: Sequence[str] = (),
    ignore: Sequence[str] = (),
    min_features: int = MIN_FEATURES,
    group_size: int | None = None,
    embeddings: bool = False,
) -> TargetPlan:
    """Decide every Linear of ``model`` (with ``embeddings``, its token embedding too: ``token_embedding``);
    ``weight_shapes`` is the checkpoint's tensor name -> shape."""
    target_res, ignore_res = _compile(targets, "--targets"), _compile(ignore, "--ignore")
    plan = TargetPlan(component=component, block_lists=block_lists(model))
    for module_name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        prefix = _checkpoint_prefix(module_name, weight_shapes)
        if prefix is None:
            continue  # tied or generated weight: nothing stored to quantize
        shape = weight_shapes[f"{prefix}.weight"]
        if shape != (module.out_features, module.in_features):
            raise InputError(
                f"{component}: tensor {prefix}.weight has shape {list(shape)}, expected "
                f"[{module.out_features}, {module.in_features}] from config.json"
            )
        layer = LinearLayer(prefix, module.in_features, module.out_features)
        if target_res:
            matched = any(r.search(prefix) for r in target_res)
            reason = None if matched else "user choice: not matched by --targets"
        else:
            reason = _boundary_reason(model, module_name, plan.block_lists)
        reason = (
            reason
            or _weight_read_reason(model, module_name)
            or _shape_reason(layer, min_features, group_size)
        )
        hit = next((r.pattern for r in ignore_res if r.search(prefix)), None)
        if reason is None and hit is not None:
            reason = f"user choice: --ignore {hit!r}"
        if reason is None:
            plan.targets[prefix] = layer
        else:
            plan.ignored[prefix] = reason
    found = token_embedding(model, weight_shapes, min_features) if embeddings else None
    if found is not None:
        prefix, outcome = found
        hit = next((r.pattern for r in ignore_res if r.search(prefix)), None)
        if isinstance(outcome, str):
            plan.ignored[prefix] = outcome
        elif target_res and not any(r.search(prefix) for r in target_res):
            plan.ignored[prefix] = "user choice: not matched by --targets"
        elif hit is not None:
            plan.ignored[prefix] = f"user choice: --ignore {hit!r}"
        else:
            plan.targets[prefix] = outcome
            plan.embeddings.add(prefix)
    for name in sorted(weight_shapes):
        prefix, _, local = name.rpartition(".")
        if local == "weight" and prefix and prefix not in plan.targets and prefix not in plan.ignored:
            plan.ignored[prefix] = f"not a Linear: {_module_class(model, prefix)} stays in source precision"
    if not plan.targets:
        raise InputError(
            f"{component}: no Linear layer to quantize (block lists found: {plan.block_lists or 'none'})"
        )
    return plan


def output_heads(model: torch.nn.Module) -> dict[str, int]:
    """The model's output head (a transformers model's ``get_output_embeddings()``, e.g. a language model's
    ``lm_head``) as module name -> its parameter count; empty for a model without one (CLIP, T5's encoder)."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if not isinstance(head, torch.nn.Linear):
        return {}
    name = next(n for n, m in model.named_modules() if m is head)
    return {name: sum(p.numel() for p in head.parameters())}


def reads_logits(pipeline_cls: type) -> bool:
    """Whether the pipeline's own code mentions ``logits`` anywhere (its class and its bases other than diffusers'
    shared machinery), read as ``_weight_read_reason`` reads a forward: then its text encoders' heads are kept."""
    for cls in getattr(pipeline_cls, "__mro__", (pipeline_cls,)):
        module = cls.__module__
        shared = module.startswith("diffusers.") and not module.startswith("diffusers.pipelines.")
        if shared or module in ("builtins", "diffusers.pipelines.pipeline_utils"):
            continue
        try:
            source = inspect.getsource(cls)
        except (OSError, TypeError):
            continue
        if re.search(r"\blogits\b", source):
            return True
    return False
