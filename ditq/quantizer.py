"""The offline quantizer: a diffusers model directory in, a servable compressed-tensors artifact out.

``quantize(source, output, scheme)`` writes into a temporary sibling of
``output`` and renames it into place at the end, so an interrupted run
leaves no ``output`` (and the next run sweeps the leftovers). Chosen
components are rewritten (targets quantized, everything else byte for
byte), other components are symlinked (or copied), ``model_index.json`` is
copied and ``MANIFEST.json`` records how and from what.

Only the source tree is read: it is scanned first (``scan_tree``), and a link
out of it, a FIFO or a device is refused unless ``follow_links`` says to read
through links, in which case their bytes are in the source digest. No file of
the artifact is more readable than the source file it comes from.
"""

from __future__ import annotations

import functools
import json
import logging
import operator
import os
import shutil
import stat
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ditq.checkpoint.layout import (
    MODEL_INDEX,
    component_class,
    is_weight_file,
    load_component_config,
    quantization_config_of,
    read_model_index,
)
from ditq.checkpoint.manifest import (
    ERRORS_FILE,
    SCHEMA_VERSION,
    file_records,
    hub_revision,
    library_versions,
    source_tree_digest,
    write_manifest,
)
from ditq.checkpoint.qconfig import (
    ConfigForm,
    quantization_config,
    resolve_config_form,
    with_quantization_config,
)
from ditq.checkpoint.rewrite import ComponentResult, read_component_headers, rewrite_component
from ditq.checkpoint.source_tree import scan_tree
from ditq.devices import resolve_device
from ditq.errors import DitqError, InputError
from ditq.fsutil import atomic_directory, atomic_write_json, exclusive_lock
from ditq.schemes import Scheme, get_scheme
from ditq.targets import MIN_FEATURES, TargetPlan, build_meta_model, plan_targets

__all__ = ["DEFAULTS", "QuantizeResult", "quantize"]

log = logging.getLogger(__name__)

# The CLI takes its defaults from here, so `ditq quantize` and `ditq.quantize` agree.
DEFAULTS: dict[str, Any] = {
    "scheme": "w8a8",
    "components": ("transformer",),
    "config_form": "flat",
    "device": "cpu",
    "max_shard_bytes": 5 * 1024**3,
    "band_bytes": 1024**2,  # source bytes per band of rows: a band's float32 working set stays in cache
}


@dataclass(frozen=True)
class QuantizeResult:
    path: Path
    manifest: dict[str, Any]


def _plan_component(
    source: Path,
    index: dict[str, Any],
    component: str,
    scheme: Scheme,
    targets: Sequence[str],
    ignore: Sequence[str],
    variant: str | None,
) -> TargetPlan:
    library, class_name = component_class(index, component)
    component_dir = source / component
    config = load_component_config(component_dir)
    if quantization_config_of(config, component) is not None:
        raise InputError(
            f"{component_dir}/config.json: component is already quantized (has quantization_config)"
        )
    shapes = {
        name: entry.shape for name, (_, entry) in read_component_headers(component_dir, variant).items()
    }
    model = build_meta_model(component_dir, library, class_name)
    return plan_targets(model, component, shapes, targets, ignore, MIN_FEATURES, scheme.group_size)


def _link_or_copy(src: Path, dst: Path, copy: bool) -> None:
    if not copy:
        os.symlink(src, dst, target_is_directory=src.is_dir())
    elif src.is_dir():
        shutil.copytree(src, dst)
    else:
        shutil.copy2(src, dst)


def _write_component(
    source: Path, tmp: Path, plan: TargetPlan, scheme: Scheme, form: ConfigForm, device, opts
) -> ComponentResult:
    src_dir, out_dir = source / plan.component, tmp / plan.component
    out_dir.mkdir()
    log.info(
        "%s: quantizing %d Linear layers (%d kept)", plan.component, len(plan.targets), len(plan.ignored)
    )
    result = rewrite_component(
        src_dir,
        out_dir,
        plan,
        scheme,
        device,
        opts["max_shard_bytes"],
        opts["band_bytes"],
        variant=opts["variant"],
    )
    for path in sorted(src_dir.iterdir()):  # the source's weights, of every variant, are replaced: not copied
        if path.name == "config.json":
            plain = quantization_config(scheme, list(plan.ignored))
            config = with_quantization_config(load_component_config(src_dir), plan.component, plain, form)
            (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        elif not is_weight_file(path.name):
            _link_or_copy(path, out_dir / path.name, copy=True)
    return result


def _link_the_rest(source: Path, tmp: Path, rewritten: set[str], copy: bool) -> dict[str, str]:
    """Copy model_index.json, link (or copy) every other entry; returns name -> link target."""
    linked: dict[str, str] = {}
    for path in sorted(source.iterdir()):
        if path.name == MODEL_INDEX:
            shutil.copyfile(path, tmp / MODEL_INDEX)
        elif path.name not in rewritten:
            _link_or_copy(path, tmp / path.name, copy)
            if not copy:
                linked[path.name] = str(path)
    return linked


def _finish(tmp: Path, manifest: dict[str, Any], results: dict[str, ComponentResult], source: Path) -> None:
    """Per-tensor errors, then the digest of every file, then the sealed manifest, then the permissions."""
    errors = {f"{c}/{prefix}": e for c, r in results.items() for prefix, e in sorted(r.errors.items())}
    atomic_write_json(tmp / ERRORS_FILE, {"metric": "relative_l2", "tensors": errors})
    written = {f"{c}/{f}": d for c, r in results.items() for f, d in r.written_files.items()}
    manifest["files"] = file_records(tmp, skip_dirs=set(manifest["linked"]), known=written)
    write_manifest(tmp, manifest)
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
    """Files 0644 and folders 0755 (temporaries are created private; an artifact is served and shared),
    but never wider than the source they come from: a 0600 source file stays 0600."""
    for path, origin in _origin_modes(tmp, source, rewritten).items():
        os.chmod(path, (0o755 if path.is_dir() else 0o644) & stat.S_IMODE(origin))


def _statistics(results: dict[str, ComponentResult]) -> dict[str, Any]:
    errors = [e for r in results.values() for e in r.errors.values()]
    return {
        "quantized_tensors": sum(r.quantized_tensors for r in results.values()),
        "quantized_params": sum(r.quantized_params for r in results.values()),
        "kept_params": sum(r.kept_params for r in results.values()),
        "mean_rel_l2": sum(errors) / len(errors) if errors else 0.0,
        "max_rel_l2": max(errors, default=0.0),
    }


def _manifest(
    source: Path, scheme: Scheme, options: dict[str, Any], plans, results, digests, linked
) -> dict[str, Any]:
    tree, source_files = digests
    index = read_model_index(source)
    return {
        "schema_version": SCHEMA_VERSION,
        "tool": "ditq",
        "inputs": {"source": str(source), "revision": hub_revision(source), **tree},
        "versions": library_versions(),
        "options": options,
        "scheme": {
            "name": scheme.name,
            "format": scheme.format,
            "group_size": scheme.group_size,
            "description": scheme.description,
        },
        "components": {
            name: {
                "class": list(component_class(index, name)),
                "quantization_config": quantization_config(scheme, list(plan.ignored)),
                "block_lists": plan.block_lists,
                "quantized": sorted(plan.targets),
                "ignored": dict(sorted(plan.ignored.items())),
                "statistics": _statistics({name: results[name]}),
            }
            for name, plan in plans.items()
        },
        "statistics": _statistics(results),
        "errors_file": ERRORS_FILE,
        "linked": linked,
        "source_files": source_files,  # what verify hashes behind the links
    }


def quantize(
    source: str | Path,
    output: str | Path,
    scheme: str = DEFAULTS["scheme"],
    *,
    components: Sequence[str] = DEFAULTS["components"],
    targets: Sequence[str] = (),
    ignore: Sequence[str] = (),
    group_size: int | None = None,
    config_form: str = DEFAULTS["config_form"],
    copy: bool = False,
    force: bool = False,
    device: str = DEFAULTS["device"],
    max_shard_bytes: int = DEFAULTS["max_shard_bytes"],
    band_bytes: int = DEFAULTS["band_bytes"],
    variant: str | None = None,
    follow_links: bool = False,
) -> QuantizeResult:
    """Quantize ``components`` of the diffusers directory ``source`` into the artifact ``output``.

    ``variant`` (``fp16``...) reads each component's variant files (``*.fp16.safetensors``) instead of the
    default ones, as diffusers' ``from_pretrained(variant=...)`` does; the artifact's files carry no variant.
    ``follow_links`` reads through symbolic links that leave the source tree (refused without it).
    """
    chosen = get_scheme(scheme, group_size)
    if isinstance(components, str):
        components = [c.strip() for c in components.split(",") if c.strip()]
    targets, ignore = ([p] if isinstance(p, str) else list(p) for p in (targets, ignore))
    source, output = Path(source).resolve(), Path(output).resolve()
    form = resolve_config_form(config_form)
    tree = scan_tree(source, follow_links)  # before any file of it is opened
    index = read_model_index(source)
    if output == source or source in output.parents:  # both resolved: a link to SRC is SRC
        raise InputError(f"{output}: the output must not be inside the source directory")
    if output in source.parents:
        raise InputError(f"{output}: the output must not hold the source directory {source}")
    torch_device = resolve_device(device)
    names = list(dict.fromkeys(components))
    options = {
        "scheme": chosen.name,
        "group_size": group_size,
        "components": names,
        "targets": list(targets),
        "ignore": list(ignore),
        "config_form": form,
        "variant": variant,
        "copy": copy,
        "follow_links": follow_links,
        "device": torch_device.type,
    }
    with exclusive_lock(output, "ditq quantize"):
        if output.exists() and not force:
            raise InputError(f"{output}: already exists (use --force to replace it)")
        stop = threading.Event()
        digest_pool = ThreadPoolExecutor(1, thread_name_prefix="ditq-digest")
        digests = digest_pool.submit(source_tree_digest, tree, stop)  # overlaps planning and writing
        try:
            plans = {c: _plan_component(source, index, c, chosen, targets, ignore, variant) for c in names}
            with atomic_directory(output, force=force) as tmp:
                limits = {"max_shard_bytes": max_shard_bytes, "band_bytes": band_bytes, "variant": variant}
                results = {
                    c: _write_component(source, tmp, p, chosen, form, torch_device, limits)
                    for c, p in plans.items()
                }
                linked = _link_the_rest(source, tmp, set(plans), copy)
                manifest = _manifest(source, chosen, options, plans, results, digests.result(), linked)
                _finish(tmp, manifest, results, source)
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
