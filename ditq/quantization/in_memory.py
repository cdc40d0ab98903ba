"""The in-memory quantizer: ``quantize_(pipe, "w8a8")`` swaps a loaded model's target Linears for ditq's
QuantizedLinears in place, and ``save(pipe, OUT)`` writes the artifact ``ditq quantize`` writes from it.

Nothing here decides anything of its own. Targets are ``ditq.quantization.targets.plan_targets`` on the module itself
(its state dict's names and shapes for the checkpoint's), a plan is ``plan_apply.apply_plan``; each weight is
encoded band by band as ``rewrite`` encodes it from a file (``encode_weight``: the same bands, codecs and error
sums); the modules are the runtime's (``linear_from_stored``), their kernel path chosen per geometry as the
loader chooses it (``prepare_quantized``, a doctor's chooser where given), the repack left to the first
forward; a pipeline's components are the ones ``--components auto`` would choose, asked of the directory it was
loaded from.

``save`` hands the in-memory layers to the offline quantizer (``quantizer.quantize(..., stored=...)``), which
re-derives its layout from that directory, checks the layers against it, and writes everything else as it
always does: the other tensors, components, ``model_index.json``, the manifest and its seal all come from the
directory. A pipeline that was not loaded from a directory cannot be saved (said in one line): the artifact's
manifest records its source, and its unquantized components are that source's files.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ditq.checkpoint.codecs import SCALE
from ditq.checkpoint.layout import MODEL_INDEX
from ditq.checkpoint.low_rank import branch_rank, check_rank
from ditq.devices import resolve_device
from ditq.errors import DitqError, InputError
from ditq.quantization.calibrated import Calibration, calibrated_layers
from ditq.quantization.low_rank import check_low_rank
from ditq.quantization.plan_apply import apply_plan
from ditq.quantization.plan_file import PlanFile, planned_rounding, read_plan
from ditq.quantization.quantizer import DEFAULTS, QuantizeResult, auto_components
from ditq.quantization.quantizer import quantize as write_artifact
from ditq.quantization.rewrite import StoredLayer, band_workers, encode_weight
from ditq.quantization.targets import MIN_FEATURES, TargetPlan, embedding_targeted, linear_at, plan_targets
from ditq.runtime.embedding import QuantizedEmbedding, embedding_from_stored
from ditq.runtime.loader import KernelChooser, prepare_quantized
from ditq.runtime.modules import QuantizedLinear, linear_from_stored, quantized_linears
from ditq.runtime.offload import streams
from ditq.schemes import SCHEMES, GroupSize, Scheme, get_scheme

__all__ = [
    "InMemoryQuantization",
    "held_linear",
    "quantize_",
    "quantized_embedding",
    "quantized_linear",
    "save",
]

log = logging.getLogger(__name__)

RECORD = "ditq_in_memory"  # the attribute of a quantized module that holds its InMemoryQuantization


@dataclass
class InMemoryQuantization:
    """How a module was quantized in memory: what ``save`` passes to the quantizer, and each layer's error."""

    component: str
    # the quantizer's keyword options that reproduce it (scheme, plan, targets, device)
    options: dict[str, Any]
    auto: bool  # its pipeline's components were chosen as ``--components auto`` chooses them
    errors: dict[str, float] = field(default_factory=dict)  # target prefix -> relative L2 error
    # target prefix -> (calibration rows left out of its Hessian, all its rows), where GPTQ left any out
    calibration_rows_left_out: dict[str, tuple[int, int]] = field(default_factory=dict)


def _source_dir(pipeline: Any, argument: str, needed_for: str) -> Path:
    """The diffusers directory a pipeline was loaded from (its ``name_or_path``), or an InputError naming
    ``argument`` and saying what it is ``needed_for``."""
    name = getattr(pipeline, "name_or_path", None)
    if not name:
        raise InputError(
            f"{argument}: the pipeline was not loaded from a directory (no name_or_path); {needed_for}"
        )
    if not (Path(name) / MODEL_INDEX).is_file():
        raise InputError(
            f"{argument}: the pipeline's name_or_path {name!r} is not a diffusers directory here; {needed_for}"
        )
    return Path(name)


def _scheme_or_plan(value: Any) -> tuple[Scheme | None, PlanFile | None, str | Path | None]:
    """(scheme, plan, the plan's path as given) from ``scheme_or_plan``: a scheme name or Scheme, a PlanFile, or a
    PLAN.json path."""
    if isinstance(value, Scheme):
        return value, None, None
    if isinstance(value, PlanFile):
        return None, value, None
    if isinstance(value, str) and value in SCHEMES:
        return get_scheme(value), None, None
    if isinstance(value, str | Path) and Path(value).suffix == ".json":
        return None, read_plan(value), value
    raise InputError(
        f"scheme_or_plan: {value!r} is neither a scheme ({', '.join(SCHEMES)}) nor a plan (PLAN.json or PlanFile)"
    )


def _swap(module: torch.nn.Module, prefix: str, layer: torch.nn.Module) -> None:
    parent_name, _, attr = prefix.rpartition(".")
    setattr(module.get_submodule(parent_name) if parent_name else module, attr, layer)


def quantized_linear(
    linear: torch.nn.Linear,
    scheme: Scheme,
    device: torch.device | None = None,
    pool: ThreadPoolExecutor | None = None,
    low_rank: int = 0,
    hold: torch.device | None = None,
) -> tuple[QuantizedLinear, float]:
    """(``linear`` quantized as ``ditq quantize`` stores it, encoded on ``device`` (None: the weight's) and held by
    the runtime's QuantizedLinear on ``hold`` (None: ``device``), its relative L2 error); ``linear`` is not changed.
    ``pool``: ``band_workers()``'s, else one for this layer. ``low_rank``: the rank of its low-rank branch (0:
    none)."""
    if pool is None:
        with band_workers() as own:
            return quantized_linear(linear, scheme, device, own, low_rank, hold)
    weight = linear.weight.detach()
    device = device if device is not None else weight.device
    stored = encode_weight(weight, scheme, device, DEFAULTS["band_bytes"], pool, low_rank)
    return held_linear(linear, stored, scheme, hold if hold is not None else device)


def quantized_embedding(
    embedding: torch.nn.Module,
    scheme: Scheme,
    device: torch.device,
    pool: ThreadPoolExecutor,
    hold: torch.device | None = None,
) -> tuple[QuantizedEmbedding, float]:
    """(the token ``embedding`` stored in ``scheme`` as ``ditq quantize`` stores it, encoded on ``device`` and held
    by the runtime's QuantizedEmbedding on ``hold`` (None: ``device``), its relative L2 error); ``embedding`` is
    not changed."""
    assert isinstance(embedding, torch.nn.Embedding)  # plan_targets chose it
    weight = embedding.weight.detach()
    stored = encode_weight(weight, scheme, device, DEFAULTS["band_bytes"], pool)
    tensors = {n: t.to(hold if hold is not None else device) for n, t in stored.tensors.items()}
    return embedding_from_stored(tensors, scheme, weight.dtype, embedding.padding_idx), stored.rel_l2


def held_linear(
    linear: torch.nn.Linear, stored: StoredLayer, scheme: Scheme, device: torch.device
) -> tuple[QuantizedLinear, float]:
    """(the runtime's QuantizedLinear holding ``stored`` and ``linear``'s bias on ``device``, its error)."""
    bias = None if linear.bias is None else linear.bias.detach().to(device)
    tensors = {n: t.to(device) for n, t in stored.tensors.items()}
    return linear_from_stored(tensors, scheme, bias), stored.rel_l2


@dataclass(frozen=True)
class _Targets:
    """A component's targets as ``_targets`` chose them: the rule, each Linear's scheme, each token embedding's."""

    rule: TargetPlan  # plan_targets': its ``ignored`` layers are kept
    schemes: dict[str, Scheme]  # Linear prefix -> its scheme
    rows: dict[str, Scheme]  # token embedding prefix -> its scheme (rounded to nearest, never calibrated)
    # the Linears GPTQ rounds under a calibration: int weights (a plan's fp8 ones round to nearest)
    rounded: dict[str, Scheme]


def _targets(
    module: torch.nn.Module,
    component: str,
    scheme: Scheme | None,
    plan: PlanFile | None,
    where: str,
    targets: list[str],
    low_rank: int,
) -> _Targets:
    """``module``'s targets and their schemes, every refusal said before any weight is encoded or request run."""
    if quantized_linears(module):
        raise InputError(f"{component}: already quantized (holds QuantizedLinear layers)")
    shapes = {name: tuple(t.shape) for name, t in module.state_dict().items()}
    group_size = None if scheme is None else scheme.guarded_group_size
    embeddings = embedding_targeted(None if plan is not None else scheme, low_rank)
    rule = plan_targets(module, component, shapes, targets, (), MIN_FEATURES, group_size, embeddings)
    if plan is None:
        assert scheme is not None
        schemes = rule.uniform(scheme)
    else:
        schemes = apply_plan(rule, plan, where)[1]
    for prefix in schemes if low_rank else ():  # before any SVD: its rank bound, a weight it can decompose
        if not branch_rank(schemes[prefix], low_rank):
            continue
        target = linear_at(module, prefix)
        check_rank(low_rank, f"{component}.{prefix}", target.out_features, target.in_features)
        if not torch.isfinite(target.weight).all():
            raise InputError(f"{component}: tensor {prefix}.weight holds NaN or Inf")
    rows = {p: schemes.pop(p) for p in rule.embeddings}
    # a plan's fp8 layers round to nearest (GPTQ rounds to int grids), as ``ditq plan --calibrate gptq`` measured them
    rounded = schemes if plan is None else {p: s for p, s in schemes.items() if s.weight_type == "int"}
    return _Targets(rule, schemes, rows, rounded)


def _quantize_module(
    module: torch.nn.Module,
    component: str,
    chosen: _Targets,
    device: torch.device | None,
    chooser: KernelChooser | None,
    calibrated: dict[str, StoredLayer],
    low_rank: int = 0,
) -> tuple[dict[str, float], torch.device]:
    """``module``'s ``chosen`` targets quantized and swapped in: the ``calibrated`` ones as GPTQ rounded them, the
    others encoded here."""
    schemes, rows, rule = chosen.schemes, chosen.rows, chosen.rule
    # the run device: the first Linear's, or the embedding's where it is the component's only target
    first: torch.Tensor = (
        linear_at(module, next(iter(schemes))).weight
        if schemes
        else module.get_submodule(next(iter(rows))).get_parameter("weight")
    )
    run_device = device if device is not None else first.device
    # a streamed module (--offload: its weights wait on the host while it runs) is quantized to be saved: its layers
    # are encoded on the run device and wait on the host beside its weights, unplaced (its offload hooks know only
    # the layers they were given), and the module is not moved
    streamed = streams(module)
    hold = torch.device("cpu") if streamed else run_device
    errors: dict[str, float] = {}
    layers: dict[str, QuantizedLinear | QuantizedEmbedding] = {}
    with band_workers() as pool:
        for prefix, layer_scheme in rows.items():
            layers[prefix], errors[prefix] = quantized_embedding(
                module.get_submodule(prefix), layer_scheme, run_device, pool, hold
            )
            if not torch.isfinite(layers[prefix].stored_tensors()[SCALE]).all():
                raise InputError(f"{component}: tensor {prefix}.weight holds NaN or Inf")
        for prefix, layer_scheme in schemes.items():
            linear = linear_at(module, prefix)
            if prefix in calibrated:
                layers[prefix], errors[prefix] = held_linear(linear, calibrated[prefix], layer_scheme, hold)
            else:
                layers[prefix], errors[prefix] = quantized_linear(
                    linear, layer_scheme, run_device, pool, low_rank, hold
                )
            if not torch.isfinite(
                layers[prefix].stored_tensors()[SCALE]
            ).all():  # as the quantizer refuses it from a file
                raise InputError(f"{component}: tensor {prefix}.weight holds NaN or Inf")
    for (
        prefix,
        layer,
    ) in layers.items():  # only once every layer is quantized: a refusal leaves no layer swapped
        _swap(module, prefix, layer)
    if streamed:
        log.info("%s: %d Linear layers quantized in memory (%d kept), held on the host to be saved (ditq.save): "
                 "the component streams, and its offload hooks do not place the new layers", component,
                 len(layers), len(rule.ignored))  # fmt: skip
        return errors, run_device
    if device is not None:
        module.to(device)
    prepare_quantized(
        module, run_device, first.dtype, chooser, repack=False
    )  # the repack: on the first forward
    log.info("%s: %d Linear layers quantized in memory (%d kept)", component, len(layers), len(rule.ignored))
    return errors, run_device


def _same_requests(planned: dict[str, Any], given: dict[str, Any]) -> None:
    """A plan's GPTQ layers rounded from other requests than it measured them with are another rounding."""
    for key, value in planned.items():
        if given.get(key) != value:
            raise InputError(
                f"calibration: {key} is {given.get(key)!r}; the plan's rounding.calibration.{key} is {value!r} "
                "(quantize a plan with the calibration requests it was measured with)"
            )


def _options(
    scheme: Scheme | None,
    plan_path: str | Path | None,
    plan: PlanFile | None,
    targets: list[str],
    low_rank: int | None,
) -> dict[str, Any]:
    if plan is not None:
        return {"plan": plan_path if plan_path is not None else plan}
    assert scheme is not None
    rank = {} if low_rank is None else {"low_rank": low_rank}
    return {"scheme": scheme.name, "group_size": scheme.group_size_option, "targets": targets} | rank


def _chosen(module_or_pipeline: Any, plan: PlanFile | None) -> tuple[dict[str, torch.nn.Module], bool]:
    """(component name -> the module to quantize, whether ``--components auto`` chose them). A module alone is
    named by its plan, else by the folder it was loaded from (its config's ``_name_or_path``), else its class."""
    if isinstance(module_or_pipeline, torch.nn.Module):
        loaded_from = getattr(getattr(module_or_pipeline, "config", None), "_name_or_path", None)
        name = Path(str(loaded_from)).name if loaded_from else type(module_or_pipeline).__name__
        return {plan.component if plan is not None else name: module_or_pipeline}, False
    components = getattr(module_or_pipeline, "components", None)
    if not isinstance(components, dict):
        raise InputError(
            "module_or_pipeline: a torch.nn.Module or a diffusers pipeline, "
            f"not {type(module_or_pipeline).__name__}"
        )
    if plan is not None:
        names, auto = [plan.component], False
    else:
        source = _source_dir(
            module_or_pipeline,
            "module_or_pipeline",
            "it tells which components ditq quantize would choose: quantize one, "
            "ditq.quantize_(pipe.transformer, ...)",
        )
        names, auto = auto_components(source), True
    missing = [n for n in names if not isinstance(components.get(n), torch.nn.Module)]
    if missing:
        raise InputError(f"module_or_pipeline: the pipeline has no model component {missing[0]!r}")
    return {n: components[n] for n in names}, auto


def quantize_(
    module_or_pipeline: Any,
    scheme_or_plan: str | Scheme | PlanFile | Path,
    *,
    targets: str | list[str] | None = None,
    device: str | torch.device | None = None,
    chooser: KernelChooser | None = None,
    calibration: Calibration | None = None,
    low_rank: int | None = None,
    group_size: GroupSize | None = None,
) -> None:
    """Quantize in place: every target Linear of a module, or of each component of a pipeline that
    ``ditq quantize --components auto`` would quantize (asked of the directory it was loaded from), becomes the
    runtime's QuantizedLinear of its scheme.

    ``scheme_or_plan``: a scheme name (``"w8a8"``, ``"fp8"``, ``"w8a16"``) or ``Scheme``, or a plan (a PLAN.json
    path or ``PlanFile``), which names its component and each layer's scheme. ``targets`` are ``--targets``
    regexes (they replace the block rule; not with a plan). ``device``: where the weights are quantized and the
    quantized modules are placed (None: where each weight is); a component that streams (``--offload``: its weights
    wait on the host while it runs) is quantized to be saved, its layers held on the host and left unplaced. ``chooser`` decides each geometry's kernel path
    (the doctor's verified choice; None: the registry's first candidate), as ``load_pipeline``'s does. Each
    quantized module keeps how it was quantized, so that ``save`` can write the artifact. ``calibration``: GPTQ
    rounding from the Hessians its requests give each target (``calibrated``; int weights only), every component
    rounded before any is swapped so that every request runs the source model; else round to nearest. ``low_rank``: SVDQuant's branch of that rank kept in bfloat16 beside every target's quantized residual
    (``--low-rank``; 4-bit schemes, below every target's smaller dimension). ``group_size``: ``--group-size``, N
    input features per scale or ``"channel"`` (``ditq.schemes.CHANNEL``: one scale per output channel; None: the
    scheme's own); not with a plan.
    """
    scheme, plan, plan_path = _scheme_or_plan(scheme_or_plan)
    if group_size is not None:
        if scheme is None:
            raise InputError("group_size: a plan names each layer's scheme, or 'keep'; give one or the other")
        scheme = scheme.grouped(group_size)
    if plan is not None:  # the plan's rounding, which its sensitivity was measured with
        rounding = planned_rounding(plan, "plan", "gptq" if calibration else "rtn", low_rank)
        low_rank = rounding.low_rank
        if calibration is not None and rounding.calibration is not None:
            _same_requests(rounding.calibration.model_dump(), calibration.manifest())
    elif low_rank is not None:
        assert scheme is not None
        low_rank = check_low_rank(low_rank, [scheme])
    patterns = [targets] if isinstance(targets, str) else list(targets or [])
    if plan is not None and patterns:
        raise InputError("targets: a plan names each layer's scheme, or 'keep'; give one or the other")
    run_device = None if device is None else resolve_device(device, option="device")
    where = str(plan_path) if plan_path is not None else "plan"
    chosen, auto = _chosen(module_or_pipeline, plan)
    picked = {
        name: _targets(module, name, scheme, plan, where, patterns, low_rank or 0)
        for name, module in chosen.items()
    }
    # calibrated: every component's layers rounded before any layer is swapped, so that every request runs the
    # source model (a component quantized first would feed the next one's Hessians its quantized outputs, and a
    # streamed one's layers, held on the host to be saved, could not run)
    calibrated = {
        name: calibrated_layers(module, picked[name].rounded, calibration, low_rank or 0, name)
        if calibration and picked[name].rounded
        else {}
        for name, module in chosen.items()
    }
    for name, module in chosen.items():
        errors, on = _quantize_module(
            module, name, picked[name], run_device, chooser, calibrated[name], low_rank or 0
        )
        options = _options(scheme, plan_path, plan, patterns, low_rank) | {"device": on.type}
        if calibration is not None:
            options["calibration"] = calibration.manifest()
        left_out = {p: (c.rows_left_out, c.rows) for p, c in calibrated[name].items() if c.rows_left_out}
        setattr(module, RECORD, InMemoryQuantization(name, options, auto, errors, left_out))


def _stored_layers(module: torch.nn.Module, record: InMemoryQuantization) -> dict[str, StoredLayer]:
    layers: dict[str, QuantizedLinear | QuantizedEmbedding] = dict(quantized_linears(module))
    layers |= {n: m for n, m in module.named_modules() if isinstance(m, QuantizedEmbedding)}
    out: dict[str, StoredLayer] = {}
    for prefix, error in record.errors.items():
        layer = layers.get(prefix)
        if layer is None:
            raise InputError(
                f"pipeline: {record.component}.{prefix}: no longer a QuantizedLinear or QuantizedEmbedding"
            )
        try:
            held = layer.stored_tensors() | (
                layer.low_rank_tensors() if isinstance(layer, QuantizedLinear) else {}
            )
            tensors = {n: t.detach().cpu() for n, t in held.items()}
        except DitqError as error_:
            raise InputError(
                f"pipeline: {record.component}.{prefix}: its stored tensors were released by the kernel repack "
                "of its first forward; call ditq.save before running the pipeline"
            ) from error_
        out[prefix] = StoredLayer(tensors, error, *record.calibration_rows_left_out.get(prefix, (0, 0)))
    return out


def save(pipeline: Any, output: str | Path, *, force: bool = False) -> QuantizeResult:
    """Write the artifact ``ditq quantize`` writes from the directory ``pipeline`` was loaded from, with the
    options ``quantize_`` was given, its quantized layers taken from memory (checked against the layout the
    quantizer derives: the same layers in the same schemes). ``force`` replaces an existing ``output``."""
    components = getattr(pipeline, "components", None)
    if not isinstance(components, dict):
        raise InputError(f"pipeline: a diffusers pipeline, not {type(pipeline).__name__}")
    records = {
        name: getattr(module, RECORD)
        for name, module in components.items()
        if isinstance(getattr(module, RECORD, None), InMemoryQuantization)
    }
    if not records:
        raise InputError("pipeline: no component was quantized in memory (call ditq.quantize_ first)")
    source = _source_dir(
        pipeline,
        "pipeline",
        "the artifact's manifest and unquantized components come from that directory: load the pipeline with "
        "from_pretrained(DIR)",
    )
    options = [r.options for r in records.values()]
    if any(o != options[0] for o in options):
        raise InputError(
            "pipeline: its components were quantized with different options; ditq quantize takes one"
        )
    auto = all(r.auto for r in records.values())
    stored = {name: _stored_layers(components[name], record) for name, record in records.items()}
    return write_artifact(
        source,
        output,
        components=None if auto else sorted(records),
        force=force,
        stored=stored,
        **options[0],
    )
