"""Writing files so that nothing is ever half-written: a temporary sibling, then a rename."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "atomic_directory",
    "atomic_write_bytes",
    "atomic_write_json",
    "sha256_file",
    "sweep_stale_temporaries",
]

_TMP_MARK = ".ditq-tmp-"


def sha256_file(path: Path, chunk_bytes: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary sibling, fsync it, rename it over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f"{_TMP_MARK}{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise


def atomic_write_json(path: Path, obj: Any, indent: int = 2) -> None:
    atomic_write_bytes(Path(path), (json.dumps(obj, indent=indent, sort_keys=False) + "\n").encode())


def sweep_stale_temporaries(final: Path) -> None:
    """Remove temporaries that an interrupted earlier run left beside ``final``."""
    final = Path(final)
    if not final.parent.exists():
        return
    for leftover in final.parent.glob(f"{_TMP_MARK}{final.name}.*"):
        if leftover.is_dir() and not leftover.is_symlink():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                leftover.unlink()


@contextlib.contextmanager
def atomic_directory(final: Path, force: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success it replaces ``final`` in one rename.

    On any exception (Ctrl-C included) the temporary is removed and ``final``
    is untouched. Leftovers of a killed earlier run are swept first.
    """
    final = Path(final)
    sweep_stale_temporaries(final)
    if final.exists() and not force:
        raise FileExistsError(f"{final} already exists (use --force to replace it)")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_MARK}{final.name}.", dir=final.parent))
    try:
        yield tmp
        if final.exists():
            old = final.with_name(f"{_TMP_MARK}{final.name}.old")
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
