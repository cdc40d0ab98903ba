"""What ditq writes, as a user finds it: files with the mode the user's umask gives (not the 0600 of a private
temporary), and results whose repr is one line (not a 10 KB manifest)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import ditq
from ditq.fsutil import atomic_write_bytes, user_mode


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_files_and_folders_take_the_users_umask(model_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    mask = os.umask(0o022)
    os.umask(mask)
    assert user_mode() == 0o666 & ~mask and user_mode(directory=True) == 0o777 & ~mask
    atomic_write_bytes(tmp_path / "one.json", b"{}")
    assert _mode(tmp_path / "one.json") == 0o666 & ~mask  # mkstemp alone gave 0o600
    source = model_dir("flux")
    for path in source.rglob("*"):  # a source the user can share (made by a library that writes files 0600)
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    result = ditq.quantize(source, tmp_path / "artifact", "w8a8")
    assert _mode(result.path) == 0o777 & ~mask & 0o755  # mkdtemp alone gave 0o700
    written = [p for p in result.path.rglob("*") if p.is_file() and not p.is_symlink()]
    assert written and all(_mode(p) == 0o666 & ~mask & 0o644 for p in written)  # never wider than the source


def test_a_result_prints_in_one_short_line(model_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    source = model_dir("flux")
    result = ditq.quantize(source, tmp_path / "artifact", "w8a8")
    shown = repr(result)
    assert "\n" not in shown and len(shown) < 300 and len(str(result.manifest)) > 1000
    assert shown.startswith(f"QuantizeResult(path='{result.path}', scheme='w8a8', components=['transformer']")
    report = ditq.verify(result.path, source=source)
    checked = sum(c.applicable for c in report.checks)
    assert repr(report) == (
        f"VerifyReport(artifact='{result.path}', ok=True, passed={checked}/{checked}, tensors={len(report.tensors)})"
    )
