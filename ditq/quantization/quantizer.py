"""The offline quantizer: a diffusers model directory in, a servable compressed-tensors artifact out.

``quantize(source, output, scheme)`` writes into a temporary sibling of
``output`` and renames it into place at the end, so an interrupted run
leaves no ``output`` (and the next run sweeps the leftovers). Chosen
components are rewritten (targets quantized, everything else byte for
byte), the other entries of the source are linked or copied as ``ditq.quantization.links`` decides (a relative link
where the source is beside the artifact, else a copy of each small one), ``model_index.json`` is copied and
``MANIFEST.json`` records how and from what.

With a plan (``quantize(source, output, plan=PLAN.json)``), its component's Linears get the schemes the plan
names, layer by layer (``ditq.quantization.plan_apply``), in one ``quantization_config`` with a config group per scheme.

With ``low_rank=R`` (``--low-rank R``, 4-bit schemes) every target keeps SVDQuant's rank-R branch in bfloat16 and
its residual is quantized (``ditq.quantization.low_rank``); the manifest names the branch per component.

Only the source tree is read: it is scanned first (``scan_tree``), and a link
out of it, a FIFO or a device is refused unless ``follow_links`` says to read
through links, in which case their bytes are in the source digest. No file of
the artifact is more readable than the source file it comes from.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import operator
import os
import shutil
import stat
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ditq.checkpoint.component import check_component_classes
from ditq.checkpoint.hub import HubSource, refuse_missing_source, resolve_source
from ditq.checkpoint.layout import (
    MODEL_INDEX,
    check_components_present,
    component_class,
    component_names,
    is_weight_file,
    load_component_config,
    quantization_config_of,
    read_model_index,
)
from ditq.checkpoint.low_rank import branch_rank, check_rank, low_rank_record
from ditq.checkpoint.manifest import (
    ERRORS_FILE,
    SCHEMA_VERSION,
    file_records,
    library_versions,
    source_tree_digest,
    write_manifest,
)
from ditq.checkpoint.qconfig import (
    ConfigForm,
    mixed_quantization_config,
    quantization_config,
    resolve_config_form,
    with_quantization_config,
)
from ditq.checkpoint.seal import seal_key
from ditq.checkpoint.source_tree import scan_tree
from ditq.checkpoint.stored import stored_specs
from ditq.devices import resolve_device
from ditq.errors import DitqError, InputError
from ditq.fsutil import (
    ARTIFACT,
    atomic_directory,
    atomic_write_json,
    check_output,
    exclusive_lock,
    sha256_file,
    user_mode,
)
from ditq.quantization.defaults import AUTO, AUTO_MIN_SHARE, DEFAULTS
from ditq.quantization.links import place_entries
from ditq.quantization.low_rank import check_low_rank
from ditq.quantization.plan_apply import apply_plan
from ditq.quantization.plan_file import KEEP, PlanFile, plan_sha256, planned_rounding, read_plan
from ditq.quantization.rewrite import ComponentResult, StoredLayer, read_component_headers, rewrite_component
from ditq.quantization.targets import (
    MIN_FEATURES,
    TargetPlan,
    build_meta_model,
    embedding_targeted,
    output_heads,
    plan_targets,
    reads_logits,
)
from ditq.schemes import SCHEMES, GroupSize, Scheme, get_scheme

__all__ = ["AUTO", "DEFAULTS", "QuantizeResult", "auto_components", "quantize"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class QuantizeResult:
    path: Path
    manifest: dict[str, Any]

    def __repr__(self) -> str:
        """One line (the manifest is kilobytes): the path, the scheme and components, the tensors quantized."""
        options, stats = self.manifest.get("options", {}), self.manifest.get("statistics", {})
        how = options.get("scheme") or ("plan" if options.get("plan") else None)
        return (
            f"QuantizeResult(path={str(self.path)!r}, scheme={how!r}, components={options.get('components')!r}, "
            f"quantized_tensors={stats.get('quantized_tensors')!r})"
        )


@dataclass(frozen=True)
class _Layout:
    """One component's outcome: what is quantized (and why the rest is not), each target's scheme, the config."""

    targets: TargetPlan
    schemes: dict[str, Scheme]  # target prefix -> its scheme
    config: dict[str, Any]  # the plain quantization_config


@dataclass(frozen=True)
class _Plan:
    """A plan as ``quantize`` was given it: the file's path as given (None: given in memory) and its digest."""

    plan: PlanFile
    path: str | None
    sha256: str

    @property
    def where(self) -> str:
        return self.path or "plan"

    @classmethod
    def of(cls, plan: PlanFile | str | Path) -> _Plan:
        if isinstance(plan, PlanFile):
            return cls(plan, None, plan_sha256(plan))
        return cls(read_plan(plan), str(plan), sha256_file(Path(plan)))

    def record(self, layout: _Layout) -> dict[str, Any]:
        """The manifest's ``plan``: where it came from and the layers per scheme it gave."""
        counts = {name: 0 for name in SCHEMES}
        for scheme in layout.schemes.values():
            counts[scheme.name] += 1
        kept = sum(1 for choice in self.plan.layers.values() if choice == KEEP)
        return {
            "path": self.path,
            "sha256": self.sha256,
            "component": self.plan.component,
            "layers": {name: n for name, n in counts.items() if n} | {KEEP: kept},
        }


def _layout(rule: TargetPlan, scheme: Scheme | None, plan: _Plan | None) -> _Layout:
    if plan is None:
        assert scheme is not None
        schemes = rule.uniform(scheme)
        # 4-bit groups and per-channel fall-backs side by side, or a token embedding (a group that targets
        # "Linear" does not take an Embedding): one group per scheme, each targeting its layers by name
        if len(set(schemes.values())) > 1 or rule.embeddings:
            return _Layout(rule, schemes, mixed_quantization_config(schemes, list(rule.ignored)))
        return _Layout(rule, schemes, quantization_config(next(iter(schemes.values())), list(rule.ignored)))
    targets, schemes = apply_plan(rule, plan.plan, plan.where)
    return _Layout(targets, schemes, mixed_quantization_config(schemes, list(targets.ignored)))


def _plan_component(
    source: Path,
    index: dict[str, Any],
    component: str,
    scheme: Scheme | None,
    targets: Sequence[str],
    ignore: Sequence[str],
    variant: str | None,
    plan: _Plan | None,
    low_rank: int = 0,
) -> _Layout:
    library, class_name = component_class(index, component)
    component_dir = source / component
    config = load_component_config(component_dir)
    if quantization_config_of(config, component) is not None:
        raise InputError(
            f"{component_dir}/config.json: component is already quantized (has quantization_config)"
        )
    entries = {name: entry for name, (_, entry) in read_component_headers(component_dir, variant).items()}
    shapes = {name: entry.shape for name, entry in entries.items()}
    model = build_meta_model(component_dir, library, class_name, entries)
    group_size = None if scheme is None else scheme.guarded_group_size
    embeddings = embedding_targeted(scheme, low_rank)
    rule = plan_targets(model, component, shapes, targets, ignore, MIN_FEATURES, group_size, embeddings)
    return _layout(rule, scheme, plan)


@dataclass(frozen=True)
class _Survey:
    """The pipeline's components as ``--components auto`` and the unused-head rule see them: each weighted
    component's parameters, its target Linears' parameters, its output head, or why it could not be built."""

    params: dict[str, int]  # component -> every stored parameter
    target_params: dict[str, int]  # component -> parameters of the Linears the block rule targets
    heads: dict[str, dict[str, int]]  # component -> output head module -> parameters
    head_bytes: dict[str, dict[str, int]]
    unbuilt: dict[str, str]  # component -> why its class could not be built on meta

    def shares(self) -> dict[str, float]:
        total = sum(self.params.values()) or 1
        return {c: self.target_params.get(c, 0) / total for c in self.params}


def _survey(source: Path, index: dict[str, Any], variant: str | None) -> _Survey:
    params: dict[str, int] = {}
    targeted: dict[str, int] = {}
    heads: dict[str, dict[str, int]] = {}
    head_bytes: dict[str, dict[str, int]] = {}
    unbuilt: dict[str, str] = {}
    for name in component_names(index):
        component_dir = source / name
        if not component_dir.is_dir() or not any(is_weight_file(p.name) for p in component_dir.iterdir()):
            continue
        entries = {n: e for n, (_, e) in read_component_headers(component_dir, variant).items()}
        params[name] = sum(math.prod(e.shape) for e in entries.values())
        library, class_name = component_class(index, name)
        if library not in ("diffusers", "transformers"):  # e.g. the demo's own text encoder class
            unbuilt[name] = f"{library}.{class_name} is not a diffusers or transformers class"
            continue
        model = build_meta_model(
            component_dir, library, class_name, entries
        )  # or refused, naming config.json
        shapes = {n: e.shape for n, e in entries.items()}
        try:
            rule = plan_targets(model, name, shapes)
            targeted[name] = sum(layer.in_features * layer.out_features for layer in rule.targets.values())
        except InputError:  # no Linear to quantize
            targeted[name] = 0
        stored = {h: n for h, n in output_heads(model).items() if f"{h}.weight" in entries}
        if stored:
            heads[name] = stored
            head_bytes[name] = {h: entries[f"{h}.weight"].nbytes for h in stored}
    return _Survey(params, targeted, heads, head_bytes, unbuilt)


def _auto_components(survey: _Survey, source: Path) -> list[str]:
    chosen = [c for c, share in survey.shares().items() if share >= AUTO_MIN_SHARE]
    if not chosen:
        raise InputError(
            f"{source}: --components auto found no component whose blocks hold {AUTO_MIN_SHARE:.0%} of the "
            "pipeline's parameters; name them with --components"
        )
    return chosen


def auto_components(source: str | Path, variant: str | None = None) -> list[str]:
    """The components ``--components auto`` quantizes in the diffusers directory ``source`` (``ditq.quantize_``
    on a pipeline asks the directory it was loaded from)."""
    source = Path(source).resolve()
    index = read_model_index(source)
    check_components_present(source, index)
    check_component_classes(source, index)
    return _auto_components(_survey(source, index, variant), source)


def _check_stored(
    stored: Mapping[str, Mapping[str, StoredLayer]], layouts: dict[str, _Layout], low_rank: int
) -> None:
    """Layers quantized in memory (``ditq.save``) must be exactly the layouts' targets, each in its scheme (and
    with a branch of rank ``low_rank`` where it is 4-bit)."""
    if set(stored) != set(layouts):
        raise InputError(
            f"pipeline: quantized in memory: {', '.join(sorted(stored))}; ditq quantize would quantize "
            f"{', '.join(sorted(layouts))} with these options"
        )
    for component, layout in layouts.items():
        have, want = set(stored[component]), set(layout.schemes)
        if have != want:
            odd = sorted(have ^ want)[0]
            side = "not quantized in memory" if odd in want else "quantized in memory only"
            raise InputError(
                f"pipeline: {component}.{odd}: {side}; the in-memory layers differ from what ditq quantize "
                f"derives from the source ({len(have)} vs {len(want)} layers)"
            )
        for prefix, scheme in layout.schemes.items():
            out_features, in_features = (
                layout.targets.targets[prefix].out_features,
                layout.targets.targets[prefix].in_features,
            )
            specs = stored_specs(scheme, out_features, in_features, low_rank)
            got = {n: (t.dtype, tuple(t.shape)) for n, t in stored[component][prefix].tensors.items()}
            if list(got.items()) != list(specs.items()):
                raise InputError(
                    f"pipeline: {component}.{prefix}: its in-memory tensors are not {scheme.name}'s stored form"
                )


def _unused(survey: _Survey, pipeline_cls: type | None, keep: bool) -> dict[str, Any]:
    """The manifest's ``unused``: per component, the modules the pipeline never reads (output heads: a diffusers
    pipeline reads its text encoders' hidden states), which the loader does not load or run. Empty with
    ``keep``, or when the pipeline's code reads logits."""
    if keep or not survey.heads or pipeline_cls is None or reads_logits(pipeline_cls):
        return {}
    reason = f"output head: {pipeline_cls.__name__} reads the text encoder's hidden states, never its logits"
    return {
        component: {
            head: {"reason": reason, "params": n, "bytes": survey.head_bytes[component][head]}
            for head, n in heads.items()
        }
        for component, heads in survey.heads.items()
    }


def _pipeline_class_or_none(index: dict[str, Any], source: Path) -> type | None:
    """The pipeline class, or None where it cannot be imported here (then no module is declared unused)."""
    from ditq.runtime.classes import pipeline_class

    try:
        return pipeline_class(index, source)
    except InputError:
        return None


def _write_component(
    source: Path,
    tmp: Path,
    layout: _Layout,
    form: ConfigForm,
    device,
    opts,
    stored: Mapping[str, StoredLayer] | None,
) -> ComponentResult:
    plan = layout.targets
    src_dir, out_dir = source / plan.component, tmp / plan.component
    out_dir.mkdir()
    log.info(
        "%s: quantizing %d Linear layers (%d kept)", plan.component, len(plan.targets), len(plan.ignored)
    )
    result = rewrite_component(
        src_dir,
        out_dir,
        plan,
        layout.schemes,
        device,
        opts["max_shard_bytes"],
        opts["band_bytes"],
        variant=opts["variant"],
        stored=stored,
        low_rank=opts["low_rank"],
    )
    for path in sorted(src_dir.iterdir()):  # the source's weights, of every variant, are replaced: not copied
        if path.name == "config.json":
            config = with_quantization_config(
                load_component_config(src_dir), plan.component, layout.config, form
            )
            (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        elif not is_weight_file(path.name):
            (shutil.copytree if path.is_dir() else shutil.copy2)(path, out_dir / path.name)
    return result


def _link_the_rest(
    source: Path, tmp: Path, rewritten: set[str], output: Path, links: str, copy_max_bytes: int
) -> dict[str, str]:
    """Copy model_index.json, link or copy every other entry (``ditq.quantization.links``); returns name -> link
    target as written."""
    shutil.copyfile(source / MODEL_INDEX, tmp / MODEL_INDEX)
    names = sorted(p.name for p in source.iterdir() if p.name != MODEL_INDEX and p.name not in rewritten)
    return place_entries(source, output, tmp, names, links, copy_max_bytes)


def _finish(
    tmp: Path, manifest: dict[str, Any], results: dict[str, ComponentResult], source: Path, key: bytes | None
) -> None:
    """Per-tensor errors, then the digest of every file, then the manifest sealed (keyed with ``key``), then
    the permissions."""
    errors = {f"{c}/{prefix}": e for c, r in results.items() for prefix, e in sorted(r.errors.items())}
    atomic_write_json(tmp / ERRORS_FILE, {"metric": "relative_l2", "tensors": errors})
    written = {f"{c}/{f}": d for c, r in results.items() for f, d in r.written_files.items()}
    manifest["files"] = file_records(tmp, skip_dirs=set(manifest["linked"]), known=written)
    write_manifest(tmp, manifest, key)
    _narrow_permissions(tmp, source, set(results))


def _origin_modes(tmp: Path, source: Path, rewritten: set[str]) -> dict[Path, int]:
    """Each file and folder of the artifact -> the permission bits of what it was made from.

    A copied file or folder: its source (through links); a rewritten component's weights: every weight file
    of the source component together; anything else (the manifest, the error file, a new index): the source
    folder it sits in.
    """
    modes: dict[Path, int] = {tmp: os.stat(source).st_mode}
    for dirpath, dirnames, filenames in os.walk(tmp):
        rel_dir = Path(dirpath).relative_to(tmp)
        for name in (*dirnames, *filenames):
            path, rel = Path(dirpath) / name, rel_dir / name
            if path.is_symlink():
                continue
            origin = source / rel
            if rel.parts[0] in rewritten and is_weight_file(name):
                weights = [p for p in (source / rel.parts[0]).iterdir() if is_weight_file(p.name)]
                modes[path] = functools.reduce(operator.and_, (os.stat(p).st_mode for p in weights))
            else:
                while not origin.exists():
                    origin = origin.parent
                modes[path] = os.stat(origin).st_mode
    return modes


def _narrow_permissions(tmp: Path, source: Path, rewritten: set[str]) -> None:
    """What the user's umask gives a new file or folder (temporaries are created private; an artifact is served
    and shared), but never wider than the source it comes from: a 0600 source file stays 0600."""
    for path, origin in _origin_modes(tmp, source, rewritten).items():
        os.chmod(path, user_mode(directory=path.is_dir()) & stat.S_IMODE(origin))


def _statistics(results: dict[str, ComponentResult]) -> dict[str, Any]:
    errors = [e for r in results.values() for e in r.errors.values()]
    return {
        "quantized_tensors": sum(r.quantized_tensors for r in results.values()),
        "quantized_params": sum(r.quantized_params for r in results.values()),
        "kept_params": sum(r.kept_params for r in results.values()),
        "mean_rel_l2": sum(errors) / len(errors) if errors else 0.0,
        "max_rel_l2": max(errors, default=0.0),
    }


def _scheme_record(scheme: Scheme) -> dict[str, Any]:
    return {
        "name": scheme.name,
        "format": scheme.format,
        "group_size": scheme.group_size,
        "description": scheme.description,
    }


def _how(scheme: Scheme | None, plan: _Plan | None, layouts: dict[str, _Layout]) -> dict[str, Any]:
    """The manifest's ``scheme`` (one for every component), or with a plan its ``schemes`` and ``plan``."""
    if plan is None:
        assert scheme is not None
        return {"scheme": _scheme_record(scheme)}
    layout = layouts[plan.plan.component]
    present = sorted(set(layout.schemes.values()), key=lambda s: list(SCHEMES).index(s.name))
    return {"schemes": [_scheme_record(s) for s in present], "plan": plan.record(layout)}


def _manifest(
    source: Path,
    origin: HubSource | None,
    how: dict[str, Any],
    options: dict[str, Any],
    layouts: dict[str, _Layout],
    results,
    digests,
    linked,
    unused: dict[str, Any],
) -> dict[str, Any]:
    tree, source_files = digests
    index = read_model_index(source)
    return {
        "schema_version": SCHEMA_VERSION,
        "tool": "ditq",
        "inputs": {  # a hub id: as it was asked for, and the commit its snapshot is
            "source": str(source),
            "hub_id": None if origin is None else origin.hub_id,
            "revision": None if origin is None else origin.revision,
            "commit": None if origin is None else origin.commit,
            **tree,
        },
        "versions": library_versions(),
        "options": options,
        **how,
        "components": {
            name: {
                "class": list(component_class(index, name)),
                "quantization_config": layout.config,
                "block_lists": layout.targets.block_lists,
                "quantized": sorted(layout.targets.targets),
                "ignored": dict(sorted(layout.targets.ignored.items())),
                "low_rank": low_rank_record(
                    options["low_rank"],
                    sum(1 for s in layout.schemes.values() if branch_rank(s, options["low_rank"] or 0)),
                ),
                "statistics": _statistics({name: results[name]}),
                # GPTQ: each layer's calibration input rows left out of its Hessian (a NaN or an infinity in
                # them), of all it was given; only layers that had any
                "calibration_rows_left_out": {
                    prefix: {"left_out": left_out, "of": rows}
                    for prefix, (left_out, rows) in sorted(results[name].calibration_rows_left_out.items())
                },
            }
            for name, layout in layouts.items()
        },
        "statistics": _statistics(results),
        "unused": unused,
        "errors_file": ERRORS_FILE,
        "linked": linked,
        "source_files": source_files,  # what verify hashes behind the links
    }


def _checked_plan(
    plan: PlanFile | str | Path,
    scheme: str | None,
    components: Sequence[str] | None,
    targets: Sequence[str],
    ignore: Sequence[str],
    group_size: GroupSize | None,
) -> _Plan:
    """The plan, refused with the options it replaces: it names each layer's scheme and its component."""
    if scheme is not None:
        raise InputError("--plan and --scheme are mutually exclusive: the plan names each layer's scheme")
    for flag, value in (
        ("--targets", targets),
        ("--ignore", ignore),
        ("--group-size", group_size is not None),
    ):
        if value:
            raise InputError(
                f"--plan and {flag} are mutually exclusive: the plan names each layer, or 'keep'"
            )
    checked = _Plan.of(plan)
    if components is not None and list(dict.fromkeys(components)) != [checked.plan.component]:
        raise InputError(
            f"--components {','.join(components)}: a plan quantizes its own component only "
            f"({checked.where}: component is {checked.plan.component!r})"
        )
    return checked


def quantize(
    source: str | Path,
    output: str | Path,
    scheme: str | None = None,
    *,
    components: Sequence[str] | str | None = None,
    targets: Sequence[str] = (),
    ignore: Sequence[str] = (),
    group_size: GroupSize | None = None,
    config_form: str = DEFAULTS["config_form"],
    copy: bool = False,
    link: bool = False,
    copy_max_bytes: int = DEFAULTS["copy_max_bytes"],
    force: bool = False,
    device: str = DEFAULTS["device"],
    max_shard_bytes: int = DEFAULTS["max_shard_bytes"],
    band_bytes: int = DEFAULTS["band_bytes"],
    variant: str | None = None,
    follow_links: bool = False,
    plan: PlanFile | str | Path | None = None,
    keep_unused: bool = False,
    local_files_only: bool = False,
    stored: Mapping[str, Mapping[str, StoredLayer]] | None = None,
    calibration: Mapping[str, Any] | None = None,
    low_rank: int | None = None,
) -> QuantizeResult:
    """Quantize ``components`` of the diffusers directory ``source`` (or hub id ``org/name[@revision]``,
    ``ditq.checkpoint.hub.resolve_source``; ``local_files_only`` or ``HF_HUB_OFFLINE``: the cache only) into the
    artifact ``output``; for a hub id the manifest's ``inputs`` record the ``hub_id`` and ``revision`` asked for and
    the ``commit`` it resolved to (a local path records none: a folder's name proves nothing).

    ``scheme`` defaults to ``DEFAULTS["scheme"]`` and ``components`` to ``DEFAULTS["components"]`` ("auto": every
    component whose block Linears hold at least ``AUTO_MIN_SHARE`` of the pipeline's parameters); ``group_size``
    (``--group-size``: N input features per scale, or ``"channel"``, ``ditq.schemes.CHANNEL``, one scale per output
    channel) changes the scheme's own, recorded as given in ``options.group_size``. ``plan`` (a
    PLAN.json path or a ``PlanFile``) instead gives each Linear of its component its own scheme or ``keep``;
    it excludes ``scheme``, ``targets``, ``ignore`` and ``group_size``, and ``components`` may only name the
    plan's component.
    ``variant`` (``fp16``...) reads each component's variant files (``*.fp16.safetensors``) instead of the
    default ones, as diffusers' ``from_pretrained(variant=...)`` does; the artifact's files carry no variant.
    ``follow_links`` reads through symbolic links that leave the source tree (refused without it).
    The source's entries that are not rewritten are linked relatively where the source is beside ``output``, else
    copied up to ``copy_max_bytes`` each and linked by absolute path above it, with a warning
    (``ditq.quantization.links``); ``link`` links every one by its absolute path, ``copy`` copies every one.
    Modules the pipeline never reads (a text encoder's output head) are declared ``unused`` in the manifest, and
    the loader neither loads nor runs them; ``keep_unused`` declares none.
    ``stored`` (component -> target -> ``StoredLayer``) holds layers already quantized in memory
    (``ditq.quantize_``, written by ``ditq.save``): they must be exactly the targets, in the schemes, derived here
    from the source, and are written as they are instead of being quantized again; ``calibration`` is how they
    were rounded (``calibrated.Calibration.manifest``: GPTQ and its requests), recorded as the manifest's
    ``options.calibration`` (round to nearest, ``{"method": "rtn"}``, where none is given).
    ``low_rank`` (a rank R, 4-bit schemes; with a plan, its 4-bit layers) keeps every such target's SVDQuant
    branch of rank R in bfloat16 beside its quantized residual (``ditq.quantization.low_rank``); R must be below
    every such target's smaller dimension. The manifest records it in ``options.low_rank`` and each component's ``low_rank``.
    """
    if copy and link:
        raise InputError("--link and --copy are mutually exclusive")
    links = "copy" if copy else "link" if link else "auto"
    if isinstance(components, str):
        components = [c.strip() for c in components.split(",") if c.strip()]
    if components is not None and AUTO in components:
        if list(components) != [AUTO]:
            raise InputError(f"--components {','.join(components)}: 'auto' stands alone")
        if plan is not None:
            raise InputError("--components auto: a plan quantizes its own component only")
    targets, ignore = ([p] if isinstance(p, str) else list(p) for p in (targets, ignore))
    named = None if components is None or list(components) == [AUTO] else components
    checked = None if plan is None else _checked_plan(plan, scheme, named, targets, ignore, group_size)
    chosen = None if checked is not None else get_scheme(scheme or DEFAULTS["scheme"], group_size)
    rank = 0  # the low-rank branch's, 0: none
    if checked is not None:  # the plan's own, which its sensitivity was measured with
        rank = planned_rounding(checked.plan, checked.where, None, low_rank).low_rank or 0
        if calibration is None and stored is None and checked.plan.rounding.method != "rtn":
            raise InputError(
                f"{checked.where}: rounding.method: {checked.plan.rounding.method}: the plan's layers are rounded "
                "from calibration requests (ditq quantize --plan runs them; in Python, ditq.quantize_ with a "
                "calibration, then ditq.save)"
            )
    elif low_rank is not None:
        assert chosen is not None
        rank = check_low_rank(low_rank, [chosen])
    given_output = Path(output)
    output = given_output.resolve()
    refuse_missing_source(source)  # the source before the destination: the order a user fixes them
    # Said at once, before the survey (or a download); checked again under the lock.
    if os.path.lexists(given_output) and not force:
        raise InputError(f"{given_output}: already exists (use --force to replace it)")
    resolved, origin = resolve_source(source, variant, local_files_only)
    source = resolved.resolve()
    form = resolve_config_form(config_form)
    key = seal_key()  # DITQ_SEAL_KEY: a keyed seal besides the plain one
    tree = scan_tree(source, follow_links)  # before any file of it is opened
    index = read_model_index(source)
    # what --force may replace: an artifact ditq wrote, nothing of the user's
    check_output(given_output, ARTIFACT, [source])
    check_components_present(source, index)
    check_component_classes(
        source, index
    )  # trusted classes, no code of the model's own, before anything is built
    survey = _survey(source, index, variant)
    if checked is not None:
        components = [checked.plan.component]
    elif named is None:
        components = _auto_components(survey, source)
    else:
        components = named
    if checked is not None and checked.plan.component not in component_names(index):
        raise InputError(
            f"{checked.where}: component: {checked.plan.component!r} is not a component of {source} "
            f"(have: {', '.join(component_names(index))})"
        )
    torch_device = resolve_device(device)
    names = list(dict.fromkeys(components))
    options = {
        "scheme": None if chosen is None else chosen.name,
        "group_size": group_size,
        "components": names,
        "components_rule": (
            {"auto": {"min_share": AUTO_MIN_SHARE, "shares": survey.shares(), "unbuilt": survey.unbuilt}}
            if named is None and checked is None
            else "named"
        ),
        "keep_unused": keep_unused,
        "targets": list(targets),
        "ignore": list(ignore),
        "config_form": form,
        "variant": variant,
        "links": links,
        "copy_max_bytes": copy_max_bytes,
        "follow_links": follow_links,
        "device": torch_device.type,
        "calibration": dict(calibration) if calibration is not None else {"method": "rtn"},
        "low_rank": rank or None,
    }
    if calibration is not None and stored is None:
        raise InputError(
            "calibration: calibrated layers come from memory (ditq.quantize_ with a calibration)"
        )
    if checked is not None:
        options["plan"] = checked.path
    with exclusive_lock(output, "ditq quantize"):
        if output.exists() and not force:
            raise InputError(f"{output}: already exists (use --force to replace it)")
        stop = threading.Event()
        digest_pool = ThreadPoolExecutor(1, thread_name_prefix="ditq-digest")
        digests = digest_pool.submit(source_tree_digest, tree, stop)  # overlaps planning and writing
        try:
            layouts = {
                c: _plan_component(source, index, c, chosen, targets, ignore, variant, checked, rank)
                for c in names
            }
            for layout in layouts.values() if rank else ():
                for prefix, layer in layout.targets.targets.items():
                    if branch_rank(layout.schemes[prefix], rank):
                        check_rank(rank, prefix, layer.out_features, layer.in_features)
            if stored is not None:
                _check_stored(stored, layouts, rank)
            with atomic_directory(output, ARTIFACT, [source], force=force) as tmp:
                limits = {
                    "max_shard_bytes": max_shard_bytes,
                    "band_bytes": band_bytes,
                    "variant": variant,
                    "low_rank": rank,
                }
                results = {
                    c: _write_component(
                        source, tmp, layout, form, torch_device, limits, None if stored is None else stored[c]
                    )
                    for c, layout in layouts.items()
                }
                linked = _link_the_rest(source, tmp, set(layouts), output, links, copy_max_bytes)
                how = _how(chosen, checked, layouts)
                unused = _unused(survey, _pipeline_class_or_none(index, source), keep_unused)
                manifest = _manifest(
                    source, origin, how, options, layouts, results, digests.result(), linked, unused
                )
                _finish(tmp, manifest, results, source, key)
        except OSError as error:
            raise DitqError(f"{output}: writing failed ({error}); nothing was left behind") from error
        finally:
            stop.set()
            digest_pool.shutdown(wait=True)
    stats = manifest["statistics"]
    log.info(
        "wrote %s: %d tensors quantized, mean rel-L2 %.4f, max %.4f",
        output,
        stats["quantized_tensors"],
        stats["mean_rel_l2"],
        stats["max_rel_l2"],
    )
    return QuantizeResult(output, manifest)
