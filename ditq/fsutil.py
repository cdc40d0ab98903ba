"""Writing files so that nothing is ever half-written (a temporary sibling, then a rename); reading only regular
files; one writer per output at a time."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ditq.errors import InputError

__all__ = [
    "atomic_directory",
    "atomic_write_bytes",
    "atomic_write_json",
    "exclusive_lock",
    "file_kind",
    "open_regular",
    "sha256_file",
    "sweep_stale_temporaries",
    "user_mode",
]

_TMP_MARK = ".ditq-tmp-"
_LOCK_MARK = ".ditq-lock-"


def _read_umask() -> int:
    """The process's umask (setting it is the only way to read it; done once, at import, before any thread)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _read_umask()


def user_mode(directory: bool = False) -> int:
    """The mode ``open`` or ``mkdir`` would give a new file (0o666) or folder (0o777) under the user's umask: what a
    temporary (made 0o600 or 0o700, private while it is written) becomes once it is the output."""
    return (0o777 if directory else 0o666) & ~_UMASK


def file_kind(mode: int) -> str:
    """What ``st_mode`` says a path is, in words."""
    kinds = {
        stat.S_ISREG: "a file",
        stat.S_ISDIR: "a directory",
        stat.S_ISFIFO: "a FIFO",
        stat.S_ISSOCK: "a socket",
    }
    return next((name for test, name in kinds.items() if test(mode)), "a device or special file")


def open_regular(path: Path) -> io.BufferedReader:
    """``path`` opened for binary reading; anything but a regular file (a FIFO, a device, a directory) is an
    InputError naming it. Opened non-blocking first, so a FIFO with no writer cannot hang the open."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise InputError(f"{path}: not a regular file ({file_kind(mode)})")
    os.set_blocking(fd, True)
    raw = io.FileIO(fd, "rb")
    raw.name = os.fspath(path)  # errors name the file, not its descriptor number
    return io.BufferedReader(raw)


def sha256_file(path: Path, chunk_bytes: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open_regular(path) as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary sibling, fsync it, rename it over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f"{_TMP_MARK}{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, user_mode())
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
def exclusive_lock(final: Path, writer: str) -> Iterator[None]:
    """Hold the one lock on writing ``final`` (a lock file beside it, removed on exit); a second ``writer``
    meanwhile is refused at once with an InputError naming ``final``, so it cannot sweep the first one's live
    temporary directory."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    lock_path = final.with_name(f"{_LOCK_MARK}{final.name}")
    while True:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise InputError(f"{final}: another {writer} is writing it (wait for it to finish)") from None
        try:  # the holder before us may have removed the file after we opened it: lock the one on disk
            if os.stat(lock_path).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock_path)
        os.close(fd)


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
        os.chmod(tmp, user_mode(directory=True))
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


def user_cache_dir() -> Path:
    """ditq's cache folder (the doctor's verdicts, compiled code): $DITQ_CACHE_DIR, else $XDG_CACHE_HOME/ditq, else
    ~/.cache/ditq."""
    override = os.environ.get("DITQ_CACHE_DIR")
    if override:
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ditq"
