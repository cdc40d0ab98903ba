"""``verify --source`` beyond the quantized tensors: every other file of the artifact against the source's.

What ``ditq quantize`` writes from a source, and so what each check row holds it to:

- ``model_index.json`` is copied: byte-identical to the source's;
- a quantized component's ``config.json`` is the source's with ``quantization_config`` added, and nothing else
  may differ; its weight files are rewritten (``verifier`` compares them tensor by tensor); every other file of
  it is copied: byte-identical;
- every other entry of the source (a text encoder, a tokenizer, the scheduler, the VAE, a README) is a symbolic
  link to the same entry of the source, or a copy of it, byte-identical file by file. A link anywhere else fails
  even where the files it reaches match today: the artifact serves whatever they become.

The cost stays bounded by what the artifact and the source hold: a link to the same entry of the source is
judged by where it leads, without listing or reading it; any other entry is listed (``scan_tree``) and a copied
file is compared by size, then by sha256, streamed, each side read at most once (the artifact's digests that
the ``files`` check took are reused, and a hub snapshot's blobs are named by their sha256).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ditq.checkpoint.layout import MODEL_INDEX, is_weight_file, load_component_config, read_json
from ditq.checkpoint.manifest import tree_file_sha256
from ditq.checkpoint.source_tree import SourceTree, hub_snapshot, scan_tree
from ditq.errors import InputError
from ditq.fsutil import sha256_file

__all__ = ["SourceRow", "files_at", "source_rows"]

SourceRow = tuple[str, list[str], str]  # (check name, problems, what passed)
_QUANTIZATION_CONFIG = "quantization_config"  # the one field ditq adds to a quantized component's config


def files_at(path: Path, name: str) -> dict[str, Path]:
    """Every file at ``path`` (a file, or a folder walked through its links), keyed ``name/...``; anything else
    (a broken link, a FIFO) is an InputError naming it."""
    if path.is_dir():
        return {f"{name}/{rel}": file for rel, file in scan_tree(path, follow_links=True).files.items()}
    if not path.is_file():
        raise InputError(f"{path}: not a regular file or folder")
    return {name: path}


class _Sides:
    """The artifact and the source, with the digests each side already has. Each entry of the source is listed
    when it is compared, so an entry the artifact links to is never walked."""

    def __init__(self, root: Path, source: Path, known: dict[str, dict[str, Any]]) -> None:
        self.root, self.source = root, source
        self.known = known  # artifact-relative path -> {"sha256", "size"} of regular files, as hashed
        snapshot = hub_snapshot(source)  # a hub snapshot's files are named by their sha256 in its blobs/
        self.hub = SourceTree(source.resolve(), None if snapshot is None else snapshot[1], files={})

    def source_files(self, name: str) -> dict[str, Path]:
        return files_at(self.source / name, name)

    def artifact_sha256(self, rel: str, path: Path) -> str:
        if rel in self.known and not path.is_symlink():
            return str(self.known[rel]["sha256"])
        return sha256_file(path)

    def differing(self, ours: dict[str, Path], theirs: dict[str, Path]) -> list[str]:
        """Each artifact-relative path that is missing, extra or not byte-identical to the source's."""
        problems = [f"{rel}: not in the source" for rel in sorted(set(ours) - set(theirs))]
        problems += [f"{rel}: in the source, not in the artifact" for rel in sorted(set(theirs) - set(ours))]
        for rel in sorted(set(ours) & set(theirs)):
            same = os.stat(ours[rel]).st_size == os.stat(theirs[rel]).st_size and self.artifact_sha256(
                rel, ours[rel]
            ) == tree_file_sha256(self.hub, theirs[rel])
            if not same:
                problems.append(f"{rel}: differs from the source's")
        return problems


def _differing_keys(ours: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    missing = object()
    return sorted(k for k in set(ours) | set(theirs) if ours.get(k, missing) != theirs.get(k, missing))


def _model_index_row(sides: _Sides) -> SourceRow:
    name, path = "model_index: source", sides.root / MODEL_INDEX
    try:  # either side missing or unreadable: one line naming the file
        keys = _differing_keys(read_json(path), read_json(sides.source / MODEL_INDEX))
        problems = sides.differing({MODEL_INDEX: path}, sides.source_files(MODEL_INDEX))
    except InputError as error:
        return name, [str(error)], ""
    if keys:
        problems = [f"{MODEL_INDEX} differs from the source's in {', '.join(keys)}"]
    return name, problems, f"{MODEL_INDEX} byte-identical to the source's"


def _quantized_row(sides: _Sides, component: str) -> SourceRow:
    """The component's config.json up to ``quantization_config``, and its other files but the weights."""
    try:
        ours = load_component_config(sides.root / component)
        theirs = load_component_config(sides.source / component)
        kept = {
            rel: p for rel, p in files_at(sides.root / component, component).items() if not _rewritten(rel)
        }
        theirs_kept = {rel: p for rel, p in sides.source_files(component).items() if not _rewritten(rel)}
        problems = sides.differing(kept, theirs_kept)
    except InputError as error:
        return f"{component}: source config", [str(error)], ""
    ours.pop(_QUANTIZATION_CONFIG, None)
    keys = _differing_keys(ours, theirs)
    if keys:
        problems.insert(0, f"{component}/config.json differs from the source's in {', '.join(keys)}")
    return (
        f"{component}: source config",
        problems,
        f"config.json the source's but for {_QUANTIZATION_CONFIG}"
        + (f", {len(kept)} other files byte-identical" if kept else ""),
    )


def _rewritten(rel: str) -> bool:
    """Whether ``ditq quantize`` writes this file of a quantized component anew: its config and its weights."""
    parts = rel.split("/")
    return len(parts) == 2 and (parts[1] == "config.json" or is_weight_file(parts[1]))


def _entry_row(sides: _Sides, name: str) -> SourceRow:
    """An entry that is linked or copied: a link to the same entry of the source, or byte-identical files."""
    row = f"{name}: source files"
    ours, theirs = sides.root / name, sides.source / name
    if not os.path.lexists(theirs):
        return row, [f"{name}: not in the source"], ""
    if not os.path.lexists(ours):
        return row, [f"{name}: in the source, not in the artifact"], ""
    if ours.is_symlink():
        target = Path(os.path.realpath(ours))
        if target != Path(os.path.realpath(theirs)):
            return row, [f"{name}: a link to {target}, not to {theirs}"], ""
        return row, [], f"a link to {theirs}"
    try:
        copied = files_at(ours, name)
        problems = sides.differing(copied, sides.source_files(name))
    except InputError as error:
        return row, [str(error)], ""
    return row, problems, f"a copy: {len(copied)} files byte-identical to the source's"


def source_rows(
    root: Path, source: Path, quantized: list[str], own: set[str], known: dict[str, dict[str, Any]]
) -> list[SourceRow]:
    """One row for ``model_index.json``, one per quantized component's config (``name: source config``) and one
    per other entry of the artifact or the source (``name: source files``). ``own``: the artifact's files that
    ditq writes of its own (the manifest, its seal, the error file); ``known``: artifact digests already taken."""
    sides = _Sides(Path(root), Path(source), known)
    entries = (set(os.listdir(root)) - own) | set(os.listdir(source))
    rows = [_model_index_row(sides)]
    for name in sorted(entries - {MODEL_INDEX}):
        rows.append(_quantized_row(sides, name) if name in quantized else _entry_row(sides, name))
    return rows
