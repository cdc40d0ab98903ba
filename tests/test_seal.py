"""The keyed seal: with DITQ_SEAL_KEY, re-sealing an artifact needs the key, and verify says whether it was keyed.

Issue 28, item 2: a plain seal can be recomputed by anyone, so it proves integrity against accidents, not
provenance.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from tiny_models import make_model_dir

import ditq
from ditq.checkpoint.manifest import MANIFEST_KEYED_SEAL, read_manifest, write_manifest
from ditq.checkpoint.seal import SEAL_KEY_ENV
from ditq.errors import InputError
from ditq.quantize.verifier import VerifyReport, verify

KEY = "correct horse battery staple"


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(source, artifact) quantized with DITQ_SEAL_KEY set. Shared: copy it before changing it."""
    folder = tmp_path_factory.mktemp("keyed")
    source = make_model_dir(folder, "flux")
    with pytest.MonkeyPatch.context() as env:
        env.setenv(SEAL_KEY_ENV, KEY)
        ditq.quantize(source, folder / "artifact", "w8a8", link=True)  # absolute links: copied elsewhere
    return source, folder / "artifact"


def _key_row(report: VerifyReport) -> tuple[str, str]:
    (row,) = [c for c in report.checks if c.name == "manifest key"]
    return row.status, row.detail


def _verify_with(key: str | None, out: Path, monkeypatch: pytest.MonkeyPatch) -> VerifyReport:
    if key is None:
        monkeypatch.delenv(SEAL_KEY_ENV, raising=False)
    else:
        monkeypatch.setenv(SEAL_KEY_ENV, key)
    return verify(out)


def test_keyed_seal_is_checked_with_the_key_only(
    keyed: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, out = keyed
    assert (out / MANIFEST_KEYED_SEAL).is_file()
    report = _verify_with(KEY, out, monkeypatch)
    assert report.ok and _key_row(report) == ("pass", f"keyed: HMAC-SHA256 under {SEAL_KEY_ENV} matches")
    report = _verify_with(None, out, monkeypatch)  # integrity is still checked; provenance is not claimed
    assert report.ok and _key_row(report) == ("n/a", f"keyed: not checked ({SEAL_KEY_ENV} is not set)")
    report = _verify_with("another key", out, monkeypatch)
    assert not report.ok and _key_row(report)[0] == "fail"
    assert [c.name for c in report.checks if not c.ok] == ["manifest key"]


def test_resealing_without_the_key_fails_with_it(
    keyed: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, shared = keyed
    out = tmp_path / "artifact"
    shutil.copytree(shared, out, symlinks=True)
    manifest = read_manifest(out)
    manifest["options"]["variant"] = None
    manifest["inputs"]["source"] = "/somewhere/else"
    write_manifest(out, manifest)  # a forger: the plain seal recomputed, no key to recompute the keyed one
    assert _verify_with(None, out, monkeypatch).ok
    status, detail = _key_row(_verify_with(KEY, out, monkeypatch))
    assert (status, detail) == (
        "fail",
        f"1 problem(s): {MANIFEST_KEYED_SEAL} does not match MANIFEST.json under {SEAL_KEY_ENV} (altered, or another key)",
    )
    (out / MANIFEST_KEYED_SEAL).unlink()  # and the keyed seal removed: a plain seal proves no provenance
    status, detail = _key_row(_verify_with(KEY, out, monkeypatch))
    assert (status, detail) == (
        "fail",
        f"1 problem(s): no {MANIFEST_KEYED_SEAL}: MANIFEST.json is not sealed with {SEAL_KEY_ENV}",
    )
    status, detail = _key_row(_verify_with(None, out, monkeypatch))
    assert (status, detail) == ("n/a", "not keyed: a plain seal proves integrity, not provenance")


@pytest.mark.parametrize("key", ["", " padded "])
def test_a_key_that_cannot_be_given_exactly_is_refused(
    key: str, keyed: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source, out = keyed
    monkeypatch.setenv(SEAL_KEY_ENV, key)
    for attempt in (lambda: verify(out), lambda: ditq.quantize(source, tmp_path / "out", "w8a8")):
        with pytest.raises(InputError, match=f"^{SEAL_KEY_ENV} is empty or has surrounding whitespace"):
            attempt()
    assert not (tmp_path / "out").exists()
