"""Writing files so that nothing is ever half-written (a temporary sibling, then a rename); reading only regular
files; one writer per output at a time; and the one rule for which folder an output may be written into or
replace (``check_output``): only a folder ditq wrote, of the same kind, never an input, the current directory
or the home folder."""

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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ditq.errors import InputError

__all__ = [
    "ARTIFACT",
    "CALIBRATION_RESUME",
    "DOCTOR_REPORT",
    "FIXTURES_SET",
    "REPORT",
    "RUN",
    "SWEEP",
    "OutputKind",
    "atomic_directory",
    "atomic_write_bytes",
    "atomic_write_json",
    "check_output",
    "exclusive_lock",
    "file_kind",
    "open_regular",
    "read_bounded",
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


def read_bounded(path: Path, max_bytes: int) -> bytes:
    """The bytes of a regular file of at most ``max_bytes``; anything else is an InputError naming it."""
    path = Path(path)
    try:
        with open_regular(path) as handle:
            data = handle.read(max_bytes + 1)
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except NotADirectoryError:
        raise InputError(f"{path}: no such file (a parent is not a directory)") from None
    except OSError as error:
        raise InputError(f"{path}: cannot be read ({error.strerror or error})") from None
    if len(data) > max_bytes:
        limit = f"{max_bytes >> 20} MiB" if max_bytes >= 1 << 20 else f"{max_bytes} bytes"
        raise InputError(f"{path}: larger than {limit}; not a file ditq reads")
    return data


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
    made = _make_parents(final.parent)
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
        for folder in made:  # the parents made for a writer that failed (a finished writer's hold its output)
            with contextlib.suppress(OSError):
                folder.rmdir()


@dataclass(frozen=True)
class OutputKind:
    """A folder ditq writes whole, and the files that mark one as its own: a folder holding any of ``markers``
    (as a regular file) was written by ditq as this kind. ``bookkeeping``: files ditq leaves in one before its
    marker is written (a lock), which do not make a folder someone else's."""

    name: str  # with its article: "an artifact", "a fixtures set", ...
    markers: tuple[str, ...]
    bookkeeping: tuple[str, ...] = ()


ARTIFACT = OutputKind("an artifact", ("MANIFEST.json",))  # ditq quantize, ditq.save
FIXTURES_SET = OutputKind("a fixtures set", ("ditq-fixtures.json",))  # ditq fixtures init
RUN = OutputKind("a run directory", ("RUN.json",), (".probe.lock",))  # ditq probe, ditq baseline
REPORT = OutputKind("a report", ("verdict.json", "REPORT.md", "report.html"))  # ditq report
SWEEP = OutputKind("a sweep", ("SWEEP.json",))  # ditq sweep
DOCTOR_REPORT = OutputKind("a doctor report", ("evidence.json",))  # ditq doctor --report
# ditq quantize --calibrate gptq: its finished groups, beside the output until it is written
CALIBRATION_RESUME = OutputKind("a calibration resume folder", ("RESUME.json",))


def _marked(folder: Path, kind: OutputKind) -> bool:
    return any((folder / m).is_file() and not (folder / m).is_symlink() for m in kind.markers)


def _relation(out: Path, other: Path) -> str | None:
    """How the resolved ``out`` stands to the resolved ``other``: "is", "holds", "is inside", or None."""
    if out == other:
        return "is"
    if out in other.parents:
        return "holds"
    if other in out.parents:
        return "is inside"
    return None


def check_output(out: Path, kind: OutputKind, inputs: Sequence[Path] = (), *, replace: bool = True) -> None:
    """The one rule for where ditq writes a folder ``out`` of ``kind``: it is not, does not hold and does not lie
    inside any of ``inputs``; where it exists it is a folder that is empty or that ditq wrote as this kind (it
    holds one of the kind's markers). With ``replace`` (``out`` is replaced whole, or removed) it is not a link and
    neither is nor holds the current directory or the home folder; without, it is written into (a run that
    resumes). Anything else is an InputError naming the folder; nothing is touched."""
    out = Path(out)
    target = Path(os.path.realpath(out))
    for given in inputs:
        relation = _relation(target, Path(os.path.realpath(given)))
        if relation is not None:
            raise InputError(f"{out}: the output {relation} the input {given}; choose a folder apart from it")
    for place, what in ((Path.cwd(), "the current directory"), (Path.home(), "the home folder")):
        relation = _relation(target, Path(os.path.realpath(place))) if replace else None
        if relation in ("is", "holds"):
            raise InputError(f"{out}: the output {relation} {what}; choose a folder of its own")
    if replace and out.is_symlink():
        raise InputError(f"{out}: a link, not {kind.name} ditq wrote; ditq replaces only its own folders")
    if not os.path.lexists(out):
        return
    if not out.is_dir():
        raise InputError(f"{out}: not a folder ({kind.name} is one); choose another place")
    held = [p for p in out.iterdir() if p.name not in kind.bookkeeping and not p.name.startswith(_TMP_MARK)]
    if held and not _marked(out, kind):
        raise InputError(
            f"{out}: not {kind.name} ditq wrote (no {' or '.join(kind.markers)}); ditq writes only into its "
            "own folders: choose a new one, or empty it yourself"
        )


def _make_parents(folder: Path) -> list[Path]:
    """Create ``folder`` and its missing parents; returns those created, deepest first."""
    missing = [p for p in (folder, *folder.parents) if not p.exists()]
    folder.mkdir(parents=True, exist_ok=True)
    return missing


@contextlib.contextmanager
def atomic_directory(
    final: Path, kind: OutputKind, inputs: Sequence[Path] = (), force: bool = False
) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success it replaces ``final`` in one rename.

    ``final`` is first held to ``check_output`` (an existing one is replaced only with ``force``, and only where
    ditq wrote it as ``kind``). On any exception (Ctrl-C included) the temporary is removed, and so are the
    parent folders made for it; ``final`` is untouched. Leftovers of a killed earlier run are swept first.
    """
    final = Path(final)
    check_output(final, kind, inputs)
    if os.path.lexists(final) and not force:
        raise FileExistsError(f"{final} already exists (use --force to replace it)")
    sweep_stale_temporaries(final)
    made = _make_parents(final.parent)
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
        for folder in made:
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise


def user_cache_dir() -> Path:
    """ditq's cache folder (the doctor's verdicts, compiled code): $DITQ_CACHE_DIR, else $XDG_CACHE_HOME/ditq, else
    ~/.cache/ditq."""
    override = os.environ.get("DITQ_CACHE_DIR")
    if override:
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ditq"
