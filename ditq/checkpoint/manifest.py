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
import threading
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ditq.checkpoint.layout import read_json
from ditq.checkpoint.seal import MANIFEST, MANIFEST_KEYED_SEAL, MANIFEST_SEAL, write_seals
from ditq.checkpoint.source_tree import SourceTree
from ditq.errors import InputError
from ditq.fsutil import atomic_write_json, open_regular, sha256_file
from ditq.runfiles import parse

__all__ = [
    "ERRORS_FILE",
    "MANIFEST",
    "MANIFEST_KEYED_SEAL",
    "MANIFEST_SEAL",
    "SCHEMA_VERSION",
    "check_manifest",
    "file_records",
    "library_versions",
    "read_manifest",
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


def file_records(
    root: Path, skip_dirs: set[str], known: dict[str, tuple[int, str]] | None = None
) -> dict[str, dict[str, Any]]:
    """relative path -> {"sha256", "size"} for every regular file under ``root`` (linked folders skipped).

    ``known`` gives (size, sha256) of files hashed while they were written; they are not read again.
    """
    known = known or {}
    records: dict[str, dict[str, Any]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        dirnames[:] = sorted(d for d in dirnames if (rel_dir / d).as_posix() not in skip_dirs)
        for name in sorted(filenames):
            path = Path(dirpath) / name
            rel = (rel_dir / name).as_posix()
            if rel in (MANIFEST, MANIFEST_SEAL, MANIFEST_KEYED_SEAL) or path.is_symlink():
                continue
            size, digest = known.get(rel) or (path.stat().st_size, sha256_file(path))
            records[rel] = {"sha256": digest, "size": size}
    return dict(sorted(records.items()))


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


class _Component(_Fields):
    # [library, class], as model_index.json names it
    class_: list[str] = Field(alias="class", min_length=2, max_length=2)
    quantization_config: dict[str, Any]
    quantized: list[str] | None = None


class _Options(_Fields):
    variant: str | None = None


class _Manifest(_Fields):
    schema_version: Literal[1]
    files: dict[str, _FileRecord]
    linked: dict[str, str]
    components: dict[str, _Component]
    source_files: dict[str, _FileRecord] | None = None
    options: _Options | None = None


def check_manifest(manifest: Any, where: str) -> dict[str, Any]:
    """``manifest`` when its fields have the types ditq writes; else an InputError naming ``where`` and the field."""
    if isinstance(manifest, dict) and manifest.get("schema_version") != SCHEMA_VERSION:
        raise InputError(
            f"{where}: schema_version {manifest.get('schema_version')!r} is not {SCHEMA_VERSION}"
        )
    parse(_Manifest, manifest, where)
    return manifest


def read_manifest(root: Path) -> dict[str, Any]:
    """The artifact's manifest; a missing manifest is an InputError (not an artifact)."""
    root = Path(root)
    if not (root / MANIFEST).is_file():
        raise InputError(f"{root}: not a ditq artifact (no {MANIFEST})")
    return check_manifest(read_json(root / MANIFEST), str(root / MANIFEST))
