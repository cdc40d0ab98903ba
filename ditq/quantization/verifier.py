"""``verify``: an artifact's digests, its quantized tensors decoded twice, and (optionally) its source.

Checks, each reported pass/fail with a one-line detail:

- **manifest**: ``MANIFEST.json`` matches its seal and parses; its keyed seal
  is checked where ``DITQ_SEAL_KEY`` is set (``ditq.checkpoint.seal``), and
  reported as not applicable, never as passed, where it is not;
- **files**: every file the manifest lists has its size and sha256; no file
  is missing or extra, and no entry is a link the manifest does not record, a FIFO or a device; linked
  components point where the manifest says, and every file behind a link is one the manifest recorded in the
  source (``source_files``), with its size and sha256, inside the linked folder (``sealed_tree_problems``: what
  the loader refuses too);
- **config** (per component): ``quantization_config`` equals the manifest's
  and each of its config groups names one of ditq's schemes;
- **tensors**: each quantized layer's scheme is its config group's, cross-checked against its tensors (the
  loader's reading, ``ditq.runtime.swap.layer_schemes``), so a mixed-precision component is checked layer by
  layer; stored dtypes and shapes follow that scheme; scales are finite
  and positive; ditq's decoder and compressed-tensors' decoder agree bit for
  bit (a token embedding stored as int8 rows, ``Scheme.embedding``, is decoded and bounded as the Linear its rows
  would be); every Linear of the model is either quantized or in ``ignore``; a low-rank branch
  (``ditq.checkpoint.low_rank``) is where the manifest's ``low_rank`` says, on every 4-bit layer or none, of
  its rank, dtype and shapes. compressed-tensors decodes the stored residual only: the decoders are compared on it,
  and the layer's weight (branch included) is ditq's alone;
- with ``source``: every dequantized weight (with its low-rank branch) is within its scheme's relative
  L2 bound of the source (``REL_L2_BOUNDS``), and every other tensor is byte
  identical to the source's; and every other file is the source's
  (``source_files``): ``model_index.json`` byte-identical, each quantized
  component's config the source's but for ``quantization_config``, each
  linked entry a link to the same entry of the source, each copied one
  byte-identical to it.

A compressed-tensors checkpoint that ditq did not write (a diffusers directory without ``MANIFEST.json``,
llm-compressor's say) gets every check but the manifest's: ``manifest`` and ``files`` are reported as not
applicable (never as passed), the config is not compared with a manifest, and the rest run as above; its
``ignore`` entries match as compressed-tensors matches them (names, ``re:`` patterns, class names). A folder that
holds a ``MANIFEST.json`` that is not a regular file fails instead, and so does every folder without a manifest
while ``DITQ_SEAL_KEY`` is set.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ditq.checkpoint.codecs import (
    SCALE,
    SCALE_DTYPES,
    Codec,
    codec_for,
    config_groups,
    quantized_layers,
    weight_features,
)
from ditq.checkpoint.component import TRUSTED_LIBRARIES, check_component_classes
from ditq.checkpoint.layout import (
    MODEL_INDEX,
    check_components_present,
    component_class,
    component_names,
    is_weight_file,
    load_component_config,
    quantization_config_of,
    read_json,
    read_model_index,
)
from ditq.checkpoint.low_rank import LOW_RANK_DOWN, LOW_RANK_NAMES, LOW_RANK_UP, branch_rank, stored_rank
from ditq.checkpoint.manifest import (
    ERRORS_FILE,
    MANIFEST,
    MANIFEST_KEYED_SEAL,
    MANIFEST_SEAL,
    SCHEMA_VERSION,
    check_manifest,
    file_records,
    is_sealed,
    sealed_tree_problems,
)
from ditq.checkpoint.reference import ReferenceDecoder
from ditq.checkpoint.safetensors_io import SafetensorsHeader, TensorEntry, read_tensor
from ditq.checkpoint.seal import SEAL_KEY_ENV, keyed_seal_verdict, manifest_digests, seal_key
from ditq.errors import DitqError, InputError
from ditq.fsutil import file_kind, open_regular, read_bounded, sha256_file
from ditq.numerics import relative_l2
from ditq.progress import progress_bar
from ditq.quantization.defaults import REL_L2_BOUNDS
from ditq.quantization.rewrite import read_component_headers
from ditq.quantization.source_files import files_at, source_rows
from ditq.quantization.targets import build_meta_model

__all__ = ["REL_L2_BOUNDS", "Check", "VerifyReport", "verify"]

# What ditq writes into an artifact besides the model: no source has them.
_OWN_FILES = {MANIFEST, MANIFEST_SEAL, MANIFEST_KEYED_SEAL, ERRORS_FILE}


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    applicable: bool = True  # False: nothing was checked (reported "n/a", never as passed)

    @property
    def status(self) -> str:
        return "n/a" if not self.applicable else "pass" if self.ok else "fail"


@dataclass
class VerifyReport:
    artifact: str
    source: str | None
    checks: list[Check] = field(default_factory=list)
    tensors: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        checked = [c for c in self.checks if c.applicable]
        return bool(checked) and all(c.ok for c in checked)

    def __repr__(self) -> str:
        """One line (``table()`` has the checks, ``tensors`` one entry per tensor): the verdict and the counts."""
        checked = [c for c in self.checks if c.applicable]
        return (
            f"VerifyReport(artifact={self.artifact!r}, ok={self.ok}, passed={sum(c.ok for c in checked)}/"
            f"{len(checked)}, tensors={len(self.tensors)})"
        )

    def add(self, name: str, problems: list[str], passed: str) -> None:
        """Record a check that fails with the first few problems, or passes with ``passed``."""
        detail = passed if not problems else f"{len(problems)} problem(s): " + "; ".join(problems[:5])
        self.checks.append(Check(name, not problems, detail))

    def not_applicable(self, name: str, why: str) -> None:
        self.checks.append(Check(name, True, why, applicable=False))

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "artifact": self.artifact,
            "source": self.source,
            "checks": [{**asdict(c), "status": c.status} for c in self.checks],
            "tensors": self.tensors,
        }

    def table(self) -> str:
        width = max((len(c.name) for c in self.checks), default=5)
        lines = [f"{c.status.upper():<4}  {c.name:<{width}}  {c.detail}" for c in self.checks]
        checked = [c for c in self.checks if c.applicable]
        passed = sum(c.ok for c in checked)
        skipped = len(self.checks) - len(checked)
        lines.append(
            f"{'OK' if self.ok else 'FAILED'}: {passed} of {len(checked)} checks passed"
            + (f", {skipped} not applicable" if skipped else "")
        )
        return "\n".join(lines)


def _check_manifest(root: Path, report: VerifyReport) -> dict[str, Any] | None:
    """The plain seal (integrity), the keyed seal (provenance, with ``DITQ_SEAL_KEY``), then the fields."""
    seal, key = root / MANIFEST_SEAL, seal_key()
    actual, mac = manifest_digests(root / MANIFEST, key)
    try:  # a seal line is 81 bytes: a larger file, a FIFO or a folder in its place is no seal
        sealed = read_bounded(seal, 256) == f"{actual}  {MANIFEST}\n".encode()
    except InputError:
        sealed = False
    report.add(
        "manifest seal",
        [] if sealed else [f"{MANIFEST} does not match {MANIFEST_SEAL}"],
        f"sha256 {actual[:16]}…",
    )
    keyed, detail = keyed_seal_verdict(root, key, mac)
    if keyed is None:
        report.not_applicable("manifest key", detail)
    else:
        report.add("manifest key", [] if keyed else [detail], detail)
    try:
        manifest = check_manifest(read_json(root / MANIFEST), MANIFEST)
    except InputError as error:
        report.add("manifest parses", [str(error)], "")
        return None
    report.add("manifest parses", [], f"schema {SCHEMA_VERSION}")
    return manifest


def _check_files(root: Path, manifest: dict[str, Any], report: VerifyReport) -> dict[str, dict[str, Any]]:
    """The files check; returns the digests it took of the artifact's own (unlinked) files."""
    listed: dict[str, Any] = manifest["files"]
    linked: dict[str, str] = manifest["linked"]
    present = file_records(root, skip_dirs=set(linked))
    problems = sealed_tree_problems(root, manifest)  # what the loader would refuse: strays, unlisted, links
    problems += [f"altered {p}" for p, rec in listed.items() if p in present and present[p] != rec]
    problems += [f"broken link {n} -> {t}: nothing at {os.path.realpath(root / n)}" for n, t in linked.items()
                 if (root / n).is_symlink() and not (root / n).exists()]  # fmt: skip
    problems += _linked_problems(root, manifest)
    behind = sum(1 for rel in manifest.get("source_files") or {} if rel.split("/")[0] in linked)
    report.add(
        "files",
        problems,
        f"{len(listed)} files match their sha256 and size, {len(linked)} links intact, "
        f"{behind} files behind them match the source's",
    )
    return present


def _linked_problems(root: Path, manifest: dict[str, Any]) -> list[str]:
    """The files behind the artifact's links against the source digests the manifest recorded for them (their
    names are ``sealed_tree_problems``')."""
    linked: dict[str, str] = manifest["linked"]
    recorded = manifest.get("source_files")
    if not linked:
        return []
    if not isinstance(recorded, dict):
        return [f"{MANIFEST} has no source_files: what {', '.join(linked)} link to cannot be checked"]
    problems: list[str] = []
    for name in linked:
        expected = {rel: r for rel, r in recorded.items() if rel.split("/")[0] == name}
        if not (root / name).exists():
            continue  # reported as a broken link
        try:
            present = files_at(root / name, name)
        except InputError as error:
            problems.append(str(error))
            continue
        where = f"(behind the link {name})"
        problems += [f"missing {rel} {where}" for rel in expected if rel not in present]
        for rel, record in expected.items():
            if rel in present and (
                os.stat(present[rel]).st_size != record.get("size")
                or sha256_file(present[rel]) != record.get("sha256")
            ):
                problems.append(f"altered {rel} {where}")
    return problems


def _check_model_index(
    root: Path, quantized: list[str], recorded: dict[str, Any], variant: str | None, report: VerifyReport
) -> None:
    """``model_index.json`` as the loader reads it: plain names and ``[library, class]`` entries, every
    component's folder, trusted classes, no component asking for code of its own, and every unquantized model
    component's declared sizes within its stored tensors (the quantized ones are checked with their tensors);
    and each quantized component's class the one the manifest records (``recorded``)."""
    from ditq.runtime.loader import check_component_sizes

    try:
        index = read_model_index(root)
        check_components_present(root, index)
        classes = check_component_classes(root, index)
        for component, cls in classes.items():
            if component not in quantized:
                check_component_sizes(root / component, cls, variant)
    except InputError as error:
        report.add("model_index", [str(error)], "")
        return
    problems = [
        f"{MODEL_INDEX}: {component} is {list(component_class(index, component)) if component in classes else None}, "
        f"the manifest records {info.get('class')}"
        for component, info in recorded.items()
        if component not in classes or list(component_class(index, component)) != info.get("class")
    ]
    report.add(
        "model_index",
        problems,
        f"{len(classes)} components, each in its folder, classes from {', '.join(TRUSTED_LIBRARIES)}, "
        "declared sizes within the stored tensors",
    )


def _check_source_files(
    root: Path,
    source: Path,
    quantized: list[str],
    own: set[str],
    known: dict[str, dict[str, Any]],
    report: VerifyReport,
) -> None:
    """With ``source``: every file but the quantized tensors against the source's (``source_files``)."""
    for name, problems, passed in source_rows(root, source, quantized, own, known):
        report.add(name, problems, passed)


def _read(where: dict[str, tuple[SafetensorsHeader, TensorEntry]], name: str) -> torch.Tensor:
    header, entry = where[name]
    with open_regular(header.path) as handle:
        return read_tensor(handle, entry)


def _raw(where: dict[str, tuple[SafetensorsHeader, TensorEntry]], name: str) -> bytes:
    header, entry = where[name]
    with open_regular(header.path) as handle:
        handle.seek(entry.begin)
        return handle.read(entry.nbytes)


def _meta_model(
    root: Path, component: str, info: dict[str, Any], where: dict[str, tuple[SafetensorsHeader, TensorEntry]]
) -> torch.nn.Module:
    """The component on meta, as the loader builds it: every stored tensor in its place, of its declared shape."""
    library, class_name = info["class"]
    entries = {name: entry for name, (_, entry) in where.items()}
    return build_meta_model(root / component, library, class_name, entries, exact=True)


def _linears(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def _stored_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Every module a quantized weight may belong to (Linears and token embeddings: ``weight_features``)."""
    return {n: m for n, m in model.named_modules() if weight_features(m) is not None}


def _shape(module: torch.nn.Module | None) -> tuple[int, int] | None:
    return None if module is None else weight_features(module)


def _layout_problem(
    codec: Codec, stored: dict[str, torch.Tensor], model_shape: tuple[int, int] | None, group_size: int | None
) -> str | None:
    """Why one Linear's stored tensors are not what the scheme stores for the model's (out, in) Linear, or None.

    ``model_shape`` None: a Linear the model's module names do not spell the same way; its own tensors say.
    """
    try:
        stored_shape = codec.features(stored)
    except DitqError as error:
        return str(error)
    out_features, in_features = model_shape or stored_shape
    specs = codec.specs(out_features, in_features, group_size)
    layout = {k: (v.dtype, tuple(v.shape)) for k, v in stored.items()}
    if SCALE in layout and layout[SCALE][0] in SCALE_DTYPES:  # every accepted scale dtype reads as float32
        layout[SCALE] = (torch.float32, layout[SCALE][1])
    if layout != specs:
        return f"stored {layout} but the scheme needs {specs}"
    if stored_shape != (out_features, in_features):
        return f"stored for a {list(stored_shape)} weight, the model's is {[out_features, in_features]}"
    return None


def _groups_text(plain: dict[str, Any], where: str) -> str:
    """The config's format and, where it has several groups, each group's scheme and target count."""
    groups = config_groups(plain, where)
    if len(groups) == 1:
        return str(plain.get("format"))
    each = ", ".join(
        f"{g.name} {g.scheme.name if g.scheme else g.weight_type} ({len(g.targets)} targets)" for g in groups
    )
    return f"{plain.get('format')}: {each}"


def _check_config(
    root: Path, component: str, info: dict[str, Any], report: VerifyReport
) -> dict[str, Any] | None:
    try:
        plain = quantization_config_of(load_component_config(root / component), component)
        if plain is None:
            raise InputError(f"{component}/config.json: no quantization_config")
        described = _groups_text(plain, f"{component}/config.json")
        ReferenceDecoder(plain)  # compressed-tensors must accept it too
    except DitqError as error:
        report.add(f"{component}: config", [str(error)], "")
        return None
    except ValueError as error:  # pydantic's ValidationError, over several lines
        refusal = " ".join(str(error).split())
        report.add(
            f"{component}: config", [f"{component}/config.json: compressed-tensors refuses it: {refusal}"], ""
        )
        return None
    manifest_config = info.get("quantization_config")  # None: no manifest to compare with
    same = manifest_config is None or plain == manifest_config
    compared = "" if manifest_config is not None else " (no manifest to compare it with)"
    report.add(
        f"{component}: config",
        [] if same else ["quantization_config differs from the manifest's"],
        f"{described}, {len(plain.get('ignore', []))} ignored, parsed by compressed-tensors{compared}",
    )
    return plain


def _check_coverage(
    component: str,
    info: dict[str, Any],
    linears: dict[str, torch.nn.Linear],
    names: set[str],
    quantized: set[str],
    report: VerifyReport,
) -> None:
    from ditq.runtime.swap import matches  # compressed-tensors' matching of names, re: patterns, class names

    ignore = list(info["quantization_config"].get("ignore", []))

    def ignored(name: str) -> bool:
        return name in ignore or (name in linears and matches(ignore, name, linears[name]))

    problems = [f"{p} quantized but listed in ignore" for p in sorted(quantized) if ignored(p)]
    if info.get("quantized") is not None and quantized != set(info["quantized"]):
        problems.append("quantized tensors differ from the manifest's list")
    for name in sorted(linears):
        if name not in quantized and not ignored(name):
            stored = f"{name}.weight" in names
            problems.append(
                f"Linear {name} {'kept in source precision' if stored else 'missing'} but not in ignore"
            )
    report.add(
        f"{component}: targets",
        problems,
        f"{len(quantized)} quantized, {len(ignore)} ignored, every Linear accounted for",
    )


def _check_tensors(
    root: Path,
    component: str,
    info: dict[str, Any],
    source: Path | None,
    report: VerifyReport,
) -> None:
    from ditq.runtime.swap import layer_schemes  # the loader's reading of each layer's scheme

    try:
        where = read_component_headers(root / component)
        model = _meta_model(root, component, info, where)
        variant = info.get("variant")
        source_where = read_component_headers(source / component, variant) if source is not None else None
    except DitqError as error:
        report.add(f"{component}: tensors", [str(error)], "")
        return
    linears = _linears(model)
    modules = _stored_modules(model)
    layers = quantized_layers(where)
    quantized = set(layers)
    _check_coverage(component, info, linears, set(where), quantized, report)
    try:
        entries = {name: entry for name, (_, entry) in where.items()}
        schemes = layer_schemes(model, entries, info["quantization_config"], f"{component}/config.json")
    except DitqError as error:
        report.add(f"{component}: decode", [str(error)], "")
        return
    decoder = ReferenceDecoder(info["quantization_config"])
    problems: list[str] = []
    source_problems: list[str] = []
    recorded = (info.get("low_rank") or {}).get("rank", 0)
    ranks: Counter[tuple[int, int]] = Counter()  # (rank found, rank expected: ``branch_rank``) -> layers
    for prefix, names in progress_bar(len(layers), f"verify {component}", "layer", iterable=layers.items()):
        scheme = schemes[prefix]
        codec, bound = codec_for(scheme), REL_L2_BOUNDS[scheme.name]
        stored = {n: _read(where, f"{prefix}.{n}") for n in names}
        row: dict[str, Any] = {"component": component, "tensor": prefix, "scheme": scheme.name}
        layout_problem = _layout_problem(codec, stored, _shape(modules.get(prefix)), scheme.group_size)
        if layout_problem is not None:
            problems.append(f"{prefix}: {layout_problem}")
            report.tensors.append({**row, "layout_ok": False})
            continue
        scale = stored[SCALE]
        scale_problem = codec.scale_problem(scale)
        row["scale_ok"] = scale_problem is None
        # in the scale's dtype, as compressed-tensors decodes (float32 for ditq's scales)
        ours, theirs = codec.decode(stored, scale.dtype), decoder.decode(stored, prefix, modules.get(prefix))
        row["decoders_agree"] = ours.dtype == theirs.dtype and torch.equal(ours, theirs)
        try:  # the shapes come from the stored tensors, as checked above
            rank = stored_rank(prefix, entries, *codec.features(stored))
        except InputError as error:
            problems.append(str(error))
            rank = 0
        ranks[(rank, branch_rank(scheme, recorded))] += 1
        if rank:  # compressed-tensors decodes the residual; the layer's weight adds the branch
            row["low_rank"] = rank
            up, down = (_read(where, f"{prefix}.{n}").to(torch.float32) for n in (LOW_RANK_UP, LOW_RANK_DOWN))
            ours = ours.to(torch.float32) + up @ down
        if scale_problem is not None:
            problems.append(f"{prefix}: {scale_problem}")
        if not row["decoders_agree"]:
            problems.append(f"{prefix}: ditq and compressed-tensors decode differently")
        if source_where is not None:
            if f"{prefix}.weight" not in source_where:
                source_problems.append(f"{prefix}.weight not in the source")
            else:
                row["rel_l2"] = relative_l2(ours, _read(source_where, f"{prefix}.weight"))
                if not row["rel_l2"] <= bound:
                    source_problems.append(
                        f"{prefix}: rel-L2 {row['rel_l2']:.4f} above the {scheme.name} bound {bound}"
                    )
        report.tensors.append(row)
    counts = ", ".join(f"{n} {s}" for s, n in sorted(Counter(s.name for s in schemes.values()).items()))
    if any(found != expected for found, expected in ranks):
        found = ", ".join(f"{n} of rank {r}" if r else f"{n} without" for (r, _), n in sorted(ranks.items()))
        problems.append(
            f"low-rank branch: the manifest records rank {recorded or 'none'} (beside 4-bit layers), the files "
            f"hold {found}"
        )
    branch = (
        f"; a rank-{recorded} low-rank branch on each 4-bit one (residual decoded by both)"
        if recorded
        else ""
    )
    report.add(
        f"{component}: decode",
        problems,
        f"{len(quantized)} tensors ({counts}): layout ok, scales finite, positive and in range, decoders agree "
        f"bitwise{branch}",
    )
    if source_where is not None:
        _check_against_source(component, where, source_where, layers, source_problems, report)


def _check_against_source(
    component: str,
    where,
    source_where,
    layers: dict[str, list[str]],
    problems: list[str],
    report: VerifyReport,
) -> None:
    derived = {f"{prefix}.{name}" for prefix, names in layers.items() for name in (*names, *LOW_RANK_NAMES)}
    kept = sorted(set(where) - derived)
    for name in kept:
        if name not in source_where:
            problems.append(f"{name}: not in the source")
        elif (
            where[name][1].dtype != source_where[name][1].dtype
            or where[name][1].shape != source_where[name][1].shape
        ):
            problems.append(f"{name}: dtype or shape differs from the source")
        elif _raw(where, name) != _raw(source_where, name):
            problems.append(f"{name}: bytes differ from the source")
    accounted = set(kept) | {f"{p}.weight" for p in layers}
    problems += [f"{n}: in the source but not in the artifact" for n in sorted(set(source_where) - accounted)]
    errors = [t["rel_l2"] for t in report.tensors if t["component"] == component and "rel_l2" in t]
    report.add(
        f"{component}: source",
        problems,
        f"max rel-L2 {max(errors, default=0.0):.4f} within bound; {len(kept)} kept tensors byte-identical",
    )


def verify(artifact: str | Path, source: str | Path | None = None) -> VerifyReport:
    """Check the artifact (and, with ``source``, its fidelity to it). ``report.ok`` says whether all holds."""
    root = Path(artifact)
    source_dir = Path(source) if source is not None else None
    key = seal_key()
    if not is_sealed(root) and key is None:
        return _verify_foreign(root, source_dir)
    if source_dir is not None:
        read_model_index(source_dir)
    report = VerifyReport(str(root), None if source_dir is None else str(source_dir))
    if not (root / MANIFEST).is_file() or (root / MANIFEST).is_symlink():
        report.add("manifest", [_no_manifest(root, key)], "")
        return report
    manifest = _check_manifest(root, report)
    if manifest is None:
        return report
    present = _check_files(root, manifest, report)
    variant = (manifest.get("options") or {}).get("variant")
    _check_model_index(root, list(manifest["components"]), manifest["components"], variant, report)
    if source_dir is not None:
        _check_source_files(root, source_dir, list(manifest["components"]), _OWN_FILES, present, report)
    for component, info in manifest["components"].items():
        plain = _check_config(root, component, info, report)
        if plain is not None:  # later checks read the artifact's own config, not the manifest's copy
            variant = (manifest.get("options") or {}).get("variant")  # the source files it was made from
            checked_info = {**info, "quantization_config": plain, "variant": variant}
            _check_tensors(root, component, checked_info, source_dir, report)
    return report


def _no_manifest(root: Path, key: bytes | None) -> str:
    """Why an artifact without a readable ``MANIFEST.json`` fails: one is there in form only (a FIFO, a folder or
    a link in its place), or the key is set, which a checkpoint without a keyed manifest never satisfies."""
    path = root / MANIFEST
    if os.path.lexists(path):
        what = "a link" if path.is_symlink() else file_kind(os.stat(path).st_mode)
        return f"{MANIFEST} is {what}, not a regular file: not an artifact ditq wrote whole"
    return (
        f"no {MANIFEST}: with {SEAL_KEY_ENV} set, an artifact without a keyed manifest fails (it is never judged "
        "as a checkpoint ditq did not write)"
    )


def _configs_missing(root: Path, components: list[str]) -> list[str]:
    """The components whose folder holds weights but no config.json (a tokenizer's or a scheduler's folder has no
    config.json, and no weights)."""
    return [
        f"{name}/config.json: missing beside its weights"
        for name in components
        if not (root / name / "config.json").is_file()
        and any(is_weight_file(p.name) for p in (root / name).iterdir())
    ]


def _verify_foreign(root: Path, source: Path | None) -> VerifyReport:
    """A compressed-tensors checkpoint without ditq's manifest: every check but the manifest's."""
    from ditq.runtime.loader import is_quantized_component

    index = read_model_index(root)
    if source is not None:
        read_model_index(source)
    components = [c for c in component_names(index) if is_quantized_component(root, c) is not None]
    if not components:
        check_components_present(root, index)  # a component without its folder, named
        unread = "".join(f"; {why}" for why in _configs_missing(root, component_names(index)))
        raise InputError(
            f"{root}: neither a ditq artifact (no {MANIFEST}) nor a compressed-tensors checkpoint "
            f"(no component's config.json has a quantization_config{unread})"
        )
    report = VerifyReport(str(root), None if source is None else str(source))
    report.not_applicable("manifest", f"no {MANIFEST}: not written by ditq")
    report.not_applicable("files", f"no {MANIFEST} lists the files, their sizes and sha256")
    _check_model_index(root, components, {}, None, report)
    if source is not None:
        _check_source_files(root, source, components, set(), {}, report)
    for component in components:
        info: dict[str, Any] = {"class": list(component_class(index, component))}
        plain = _check_config(root, component, info, report)
        if plain is not None:
            _check_tensors(root, component, {**info, "quantization_config": plain}, source, report)
    return report
