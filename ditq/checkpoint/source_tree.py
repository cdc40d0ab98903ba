"""The source tree: every file under a model directory, confined to it, listed before anything is read.

``scan_tree(root)`` walks ``root`` once with ``lstat`` (nothing is opened) and
refuses, naming the path, anything ``ditq quantize`` must not read or publish:
a FIFO, socket or device; a broken link or a link loop; and a symbolic link
that resolves outside the tree unless ``follow_links`` says to read it. The
tree is ``root`` and, for a hub snapshot (``.../models--org--name/snapshots/<rev>``),
the repository's ``blobs/`` folder its links point into. Every later read of
the source is of a file this scan listed, and the manifest's source digest is
taken over exactly these files, links followed, so it covers whatever a
followed link brought in.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from ditq.errors import InputError
from ditq.fsutil import file_kind

__all__ = ["SourceTree", "hub_snapshot", "scan_tree"]


@dataclass(frozen=True)
class SourceTree:
    root: Path  # resolved
    hub_blobs: Path | None  # a hub snapshot's blobs/ folder (resolved), else None
    files: dict[str, Path]  # relative path (posix) -> the path under root, through any links

    def is_hub_blob(self, path: Path) -> bool:
        """Whether ``path`` resolves into the snapshot's own ``blobs/`` folder (a file named by its sha256)."""
        return self.hub_blobs is not None and Path(os.path.realpath(path)).parent == self.hub_blobs


def hub_snapshot(root: Path) -> tuple[str, Path] | None:
    """(revision, blobs folder) of a hub snapshot (``.../models--org--name/snapshots/<revision>``), else None."""
    root = Path(root).resolve()
    parts = root.parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-1], (root.parent.parent / "blobs").resolve()
    return None


def _is_inside(path: Path, folders: tuple[Path, ...]) -> bool:
    return any(path == folder or folder in path.parents for folder in folders)


def scan_tree(root: Path, follow_links: bool = False) -> SourceTree:
    """List every regular file under ``root``; refuse what must not be read (see the module docstring)."""
    root = Path(root).resolve()
    if not root.is_dir():
        raise InputError(f"{root}: not a directory")
    snapshot = hub_snapshot(root)
    inside = (root,) if snapshot is None else (root, snapshot[1])
    files: dict[str, Path] = {}

    def walk(folder: Path, rel: Path, seen: frozenset[Path]) -> None:
        for entry in sorted(os.scandir(folder), key=lambda e: e.name):
            path, rel_path = Path(entry.path), rel / entry.name
            if entry.is_symlink():
                target = Path(os.path.realpath(path))
                if not target.exists():
                    raise InputError(f"{path}: a broken symbolic link")
                if not follow_links and not _is_inside(target, inside):
                    raise InputError(
                        f"{path}: a symbolic link to {target}, outside {root} (--follow-links reads it)"
                    )
            mode = os.stat(path).st_mode  # through a link
            if stat.S_ISDIR(mode):
                real = Path(os.path.realpath(path))
                if real in seen:
                    raise InputError(f"{path}: a symbolic link loop")
                walk(path, rel_path, seen | {real})
            elif stat.S_ISREG(mode):
                files[rel_path.as_posix()] = path
            else:
                raise InputError(f"{path}: not a regular file or folder ({file_kind(mode)})")

    walk(root, Path(), frozenset({root}))
    return SourceTree(root, None if snapshot is None else snapshot[1], files)
