"""MANIFEST.json: what an artifact was made from, with what, and the digest of every file in it.

``MANIFEST.json`` is sealed by ``MANIFEST.json.sha256`` (``sha256sum``
format), so a change to any byte of the manifest itself is detected too, and
with ``DITQ_SEAL_KEY`` set also by ``MANIFEST.json.hmac`` (``ditq.checkpoint.seal``
says what each proves).
The source's tree digest is sha256 over the sorted lines
``<sha256> <size> <relative path>`` of every file under the source
directory (symlinks followed), and ``source_files`` keeps each line's
sha256 and size, so ``verify`` can hash what the artifact's links point at.
Files of a hub snapshot are named by their sha256 in ``blobs/``, which is
used as is instead of re-reading them.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import re
import stat
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ditq.checkpoint.layout import read_json
from ditq.checkpoint.seal import MANIFEST, MANIFEST_KEYED_SEAL, MANIFEST_SEAL, write_seals
from ditq.checkpoint.source_tree import SourceTree, hub_snapshot
from ditq.errors import InputError
from ditq.fsutil import atomic_write_json, file_kind, open_regular, sha256_file
from ditq.runfiles import parse

__all__ = [
    "ERRORS_FILE",
    "MANIFEST",
    "MANIFEST_KEYED_SEAL",
    "MANIFEST_SEAL",
    "SCHEMA_VERSION",
    "artifact_tree",
    "check_manifest",
    "check_sealed_reads",
    "file_records",
    "is_sealed",
    "library_versions",
    "read_manifest",
    "sealed_tree_problems",
    "source_tree_digest",
    "tree_file_sha256",
    "write_manifest",
]

SCHEMA_VERSION = 1
ERRORS_FILE = "tensor_errors.json"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_LIBRARIES = ("ditq", "torch", "safetensors", "compressed-tensors", "diffusers", "transformers", "numpy")


def library_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in _LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def tree_file_sha256(tree: SourceTree, path: Path, stop: threading.Event | None = None) -> str:
    """The sha256 of a file of the scanned ``tree``, streamed; a hub snapshot's blob is named by it (not read).
    ``stop`` abandons it."""
    if tree.is_hub_blob(path) and _HEX64.match(Path(os.path.realpath(path)).name):
        return Path(os.path.realpath(path)).name
    digest = hashlib.sha256()
    buffer = memoryview(bytearray(1 << 22))  # one reused buffer: no allocation per chunk
    with open_regular(path) as handle:
        while count := handle.readinto(buffer):
            if stop is not None and stop.is_set():
                raise InterruptedError(f"digest of {path} abandoned")
            digest.update(buffer[:count])
    return digest.hexdigest()


def source_tree_digest(
    tree: SourceTree, stop: threading.Event | None = None
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """({"tree_digest": "sha256:...", "files": n, "bytes": n}, {relative path: {"sha256", "size"}}) over every
    file of the scanned source ``tree``.

    Meant to run on a background thread while the source is quantized; ``stop`` abandons it.
    """
    stop = stop or threading.Event()
    records: dict[str, dict[str, Any]] = {}
    for rel, path in sorted(tree.files.items()):
        size = os.stat(path).st_size
        records[rel] = {"sha256": tree_file_sha256(tree, path, stop), "size": size}
    lines = "".join(f"{r['sha256']} {r['size']} {rel}\n" for rel, r in records.items())
    digest = hashlib.sha256(lines.encode()).hexdigest()
    total = sum(r["size"] for r in records.values())
    return {"tree_digest": f"sha256:{digest}", "files": len(records), "bytes": total}, records


_OWN = (MANIFEST, MANIFEST_SEAL, MANIFEST_KEYED_SEAL)


def artifact_tree(root: Path, linked: Mapping[str, str]) -> tuple[dict[str, Path], list[str]]:
    """(relative path -> path of every regular file of the artifact ``root`` but its links and its own seals,
    strays): a stray is any other entry, named: a link the manifest does not record among ``linked``, a FIFO, a
    socket or a device. Recorded links are neither followed nor listed."""
    files: dict[str, Path] = {}
    strays: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        kept = []
        for name in sorted(dirnames):
            rel = (rel_dir / name).as_posix()
            if rel in linked:
                continue
            if os.path.islink(Path(dirpath) / name):
                strays.append(
                    f"{rel}: a link the manifest does not record (to {os.readlink(Path(dirpath) / name)})"
                )
            else:
                kept.append(name)
        dirnames[:] = kept
        for name in sorted(filenames):
            path, rel = Path(dirpath) / name, (rel_dir / name).as_posix()
            mode = os.lstat(path).st_mode
            if rel in linked or rel in _OWN:
                continue
            if stat.S_ISLNK(mode):
                strays.append(f"{rel}: a link the manifest does not record (to {os.readlink(path)})")
            elif not stat.S_ISREG(mode):
                strays.append(f"{rel}: {file_kind(mode)}, not a regular file")
            else:
                files[rel] = path
    return files, strays


def file_records(
    root: Path, skip_dirs: set[str], known: dict[str, tuple[int, str]] | None = None
) -> dict[str, dict[str, Any]]:
    """relative path -> {"sha256", "size"} for every regular file under ``root`` (its links, ``skip_dirs``,
    neither followed nor listed: ``artifact_tree``).

    ``known`` gives (size, sha256) of files hashed while they were written; they are not read again.
    """
    known = known or {}
    files, _ = artifact_tree(root, dict.fromkeys(skip_dirs, ""))
    records: dict[str, dict[str, Any]] = {}
    for rel, path in files.items():
        size, digest = known.get(rel) or (path.stat().st_size, sha256_file(path))
        records[rel] = {"sha256": digest, "size": size}
    return dict(sorted(records.items()))


def sealed_tree_problems(root: Path, manifest: Mapping[str, Any]) -> list[str]:
    """What the artifact ``root`` holds beyond what its ``manifest`` lists, by name only (no file is read): strays
    (``artifact_tree``), files it does not list, listed files that are missing, recorded links that are not the
    links recorded, and behind each link a file the manifest's ``source_files`` does not list or one whose path
    leads out of the link's folder (unless the artifact was made with ``follow_links``). What the loader reads is
    then only what verify checks."""
    linked: dict[str, str] = dict(manifest.get("linked") or {})
    files, problems = artifact_tree(root, linked)
    listed = manifest.get("files") or {}
    problems += [f"extra {rel} (not listed in {MANIFEST})" for rel in files if rel not in listed]
    problems += [f"missing {rel}" for rel in listed if rel not in files]
    follow = bool((manifest.get("options") or {}).get("follow_links"))
    recorded = manifest.get("source_files")
    for name, target in linked.items():
        link = root / name
        if not link.is_symlink() or os.readlink(link) != target:
            problems.append(f"{name}: not the link to {target} that {MANIFEST} records")
        elif link.exists():
            problems += _behind_link(link, name, recorded if isinstance(recorded, dict) else None, follow)
    return problems


def _behind_link(link: Path, name: str, recorded: Mapping[str, Any] | None, follow: bool) -> list[str]:
    """The files behind the artifact's link ``name``: each listed in ``recorded`` (the source's files), each inside
    the folder the link leads to (or its hub snapshot's blobs/), unless ``follow``."""
    folder = Path(os.path.realpath(link))
    snapshot = hub_snapshot(folder.parent)
    inside = (folder,) if snapshot is None else (folder, snapshot[1])
    if not folder.is_dir():
        return [] if recorded is None or name in recorded else [f"extra {name} (behind the link {name})"]
    problems = []
    for dirpath, _, filenames in os.walk(link, followlinks=True):
        for file in sorted(filenames):
            path = Path(dirpath) / file
            rel = f"{name}/{path.relative_to(link).as_posix()}"
            real = Path(os.path.realpath(path))
            if recorded is not None and rel not in recorded:
                problems.append(f"extra {rel} (behind the link {name})")
            elif not follow and not any(real == f or f in real.parents for f in inside):
                problems.append(f"{rel} (behind the link {name}): a link out of its folder, to {real}")
    return problems


def write_manifest(root: Path, manifest: dict[str, Any], key: bytes | None = None) -> None:
    """The manifest and its plain seal; with ``key`` (``seal.seal_key``) its keyed seal too."""
    atomic_write_json(Path(root) / MANIFEST, manifest)
    write_seals(Path(root), key)


class _Fields(BaseModel):
    """The types of the fields that verify and the loader read; the manifest may hold others."""

    model_config = ConfigDict(extra="allow", strict=True)


class _FileRecord(_Fields):
    sha256: str
    size: int = Field(ge=0)


class _Statistics(_Fields):
    """The quantizer's report of what it did: counts, and the layers' relative errors, always finite (it refuses a
    non-finite weight, and ``ditq.numerics.relative_l2`` never divides by zero): a NaN or an infinity here is a
    manifest ditq did not write."""

    quantized_tensors: int = Field(ge=0)
    quantized_params: int = Field(ge=0)
    kept_params: int = Field(ge=0)
    mean_rel_l2: float = Field(ge=0, allow_inf_nan=False)
    max_rel_l2: float = Field(ge=0, allow_inf_nan=False)


class _Component(_Fields):
    # [library, class], as model_index.json names it
    class_: list[str] = Field(alias="class", min_length=2, max_length=2)
    quantization_config: dict[str, Any]
    quantized: list[str] | None = None
    statistics: _Statistics | None = None


class _Options(_Fields):
    variant: str | None = None


class _Manifest(_Fields):
    schema_version: Literal[1]
    files: dict[str, _FileRecord]
    linked: dict[str, str]
    components: dict[str, _Component]
    source_files: dict[str, _FileRecord] | None = None
    options: _Options | None = None
    statistics: _Statistics | None = None


def check_manifest(manifest: Any, where: str) -> dict[str, Any]:
    """``manifest`` when its fields have the types ditq writes; else an InputError naming ``where`` and the field."""
    if isinstance(manifest, dict) and manifest.get("schema_version") != SCHEMA_VERSION:
        raise InputError(
            f"{where}: schema_version {manifest.get('schema_version')!r} is not {SCHEMA_VERSION}"
        )
    parse(_Manifest, manifest, where)
    return manifest


def read_manifest(root: Path) -> dict[str, Any]:
    """The artifact's manifest; a missing manifest is an InputError (not an artifact), and so is one that is not
    a regular file (``read_json``)."""
    root = Path(root)
    if not os.path.lexists(root / MANIFEST):
        raise InputError(f"{root}: not a ditq artifact (no {MANIFEST})")
    return check_manifest(read_json(root / MANIFEST), str(root / MANIFEST))


def is_sealed(root: Path) -> bool:
    """Whether ``root`` carries ditq's manifest, in any form (a FIFO or a folder in its place too)."""
    return os.path.lexists(Path(root) / MANIFEST)


def check_sealed_reads(root: Path) -> None:
    """For a ditq artifact (``is_sealed``): its manifest reads, and the artifact holds nothing it does not list
    (``sealed_tree_problems``), else an InputError naming the first problem, so that a loader reads only files
    the manifest lists or links it records. A folder without a manifest is not ditq's: nothing to check."""
    root = Path(root)
    if not is_sealed(root):
        return
    problems = sealed_tree_problems(root, read_manifest(root))
    if problems:
        more = f" (and {len(problems) - 1} more: ditq verify names each)" if len(problems) > 1 else ""
        raise InputError(f"{root}: {problems[0]}{more}; ditq loads only what {MANIFEST} lists")
