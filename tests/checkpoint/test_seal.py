"""The keyed seal: with DITQ_SEAL_KEY, re-sealing an artifact needs the key, and verify says whether it was keyed.

Issue 28, item 2: a plain seal can be recomputed by anyone, so it proves integrity against accidents, not
provenance.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from tiny_models import make_model_dir

import ditq
from ditq.checkpoint.manifest import MANIFEST_KEYED_SEAL, read_manifest, write_manifest
from ditq.checkpoint.seal import SEAL_KEY_ENV
from ditq.cli import main
from ditq.errors import InputError
from ditq.quantization.verifier import VerifyReport, verify

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


# Issue 48: what loads is what is sealed. A keyed --copy artifact (every entry a folder of its own) and a --link
# one (the text encoder a link into the source), tampered; each tampering fails verify, keyed or not, and the
# loader refuses it in one line, before anything is built.


@pytest.fixture(scope="module")
def keyed_copy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(source with a T5 text encoder, its transformer quantized, --copy, keyed). Copy it before changing it."""
    folder = tmp_path_factory.mktemp("keyed-copy")
    source = make_model_dir(folder, "flux", text_encoder=True)
    with pytest.MonkeyPatch.context() as env:
        env.setenv(SEAL_KEY_ENV, KEY)
        ditq.quantize(source, folder / "artifact", "w8a8", components=["transformer"], copy=True)
        ditq.quantize(source, folder / "linked", "w8a8", components=["transformer"], link=True)
    return source, folder


def _elsewhere(tmp: Path, source: Path) -> Path:
    """An attacker's text encoder: the source's, its weights zeroed, outside the artifact."""
    import torch
    from safetensors.torch import load_file, save_file

    other = tmp / "attacker"
    shutil.copytree(source / "text_encoder", other)
    for path in other.glob("*.safetensors"):
        save_file({k: torch.zeros_like(v) for k, v in load_file(path).items()}, path)
    return other


def _linked_index_and_shard(artifact: Path, tmp: Path, source: Path) -> str:
    other = _elsewhere(tmp, source)
    shard = next(other.glob("*.safetensors"))
    (other / "index.json").write_text(json.dumps({"weight_map": {"shared.weight": "evil.safetensors"}}))
    (artifact / "text_encoder" / "model.safetensors.index.json").symlink_to(other / "index.json")
    (artifact / "text_encoder" / "evil.safetensors").symlink_to(shard)
    return "a link the manifest does not record"


def _unlisted_shard(artifact: Path, tmp: Path, source: Path) -> str:
    shard = next(_elsewhere(tmp, source).glob("*.safetensors"))
    shutil.copy(shard, artifact / "text_encoder" / "model-00001-of-00001.safetensors")
    return "extra text_encoder/model-00001-of-00001.safetensors (not listed in MANIFEST.json)"


def _fifo_in_a_component(artifact: Path, tmp: Path, source: Path) -> str:
    os.mkfifo(artifact / "transformer" / "extra.safetensors")
    return "a FIFO, not a regular file"


def _link_out_of_a_linked_folder(artifact: Path, tmp: Path, source: Path) -> str:
    behind = Path(
        os.path.realpath(artifact / "text_encoder")
    )  # the source's folder, behind the recorded link
    shard = next(_elsewhere(tmp, source).glob("*.safetensors"))
    target = next(behind.glob("*.safetensors"))
    target.unlink()
    target.symlink_to(shard)
    return "a link out of its folder"


TAMPERINGS = {
    "a linked index and shard in a copied text encoder": ("artifact", _linked_index_and_shard),
    "an unlisted shard in a copied text encoder": ("artifact", _unlisted_shard),
    "a FIFO in the transformer": ("artifact", _fifo_in_a_component),
    "a source file behind a link, linked out of its folder": ("linked", _link_out_of_a_linked_folder),
}


@pytest.mark.parametrize("name", list(TAMPERINGS))
@pytest.mark.parametrize("key", [KEY, None], ids=["keyed", "unkeyed"])
def test_what_the_manifest_does_not_list_fails_verify_and_is_never_loaded(
    name: str, key: str | None, keyed_copy: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source, shared = keyed_copy
    which, tamper = TAMPERINGS[name]
    copy = tmp_path / "copy"
    shutil.copytree(
        shared, copy, symlinks=True
    )  # the --link artifact's links are absolute: into the shared source
    if which == "linked":  # a private source, so that tampering behind the link touches no other test's
        private = tmp_path / "source"
        shutil.copytree(source, private)
        link = copy / "linked" / "text_encoder"
        link.unlink()
        link.symlink_to(private / "text_encoder")
        manifest = read_manifest(copy / "linked")
        manifest["linked"]["text_encoder"] = str(private / "text_encoder")
        with monkeypatch.context() as env:
            env.setenv(SEAL_KEY_ENV, KEY)
            write_manifest(copy / "linked", manifest, KEY.encode())  # as made: the link's target recorded
        source = private
    artifact = copy / which
    said = tamper(artifact, tmp_path, source)
    report = _verify_with(key, artifact, monkeypatch)
    files = next(c for c in report.checks if c.name == "files")
    assert not report.ok and not files.ok and said in files.detail, files.detail
    with pytest.raises(
        InputError, match=rf"^{artifact}: .*{re.escape(said)}.*ditq loads only what MANIFEST\.json"
    ):
        ditq.load_pipeline(artifact, device="cpu")


def _removed(artifact: Path) -> None:
    (artifact / "MANIFEST.json").unlink()
    (artifact / MANIFEST_KEYED_SEAL).unlink()
    (artifact / "MANIFEST.json.sha256").unlink()


def _fifo(artifact: Path) -> None:
    (artifact / "MANIFEST.json").unlink()
    os.mkfifo(artifact / "MANIFEST.json")


def _folder(artifact: Path) -> None:
    (artifact / "MANIFEST.json").unlink()
    (artifact / "MANIFEST.json").mkdir()


@pytest.mark.parametrize(
    ("drop", "keys"),
    [(_removed, [KEY]), (_fifo, [KEY, None]), (_folder, [KEY, None])],
    ids=["removed with its seals", "a FIFO in its place", "a folder in its place"],
)
def test_a_keyed_manifest_cannot_be_dropped(
    drop: Callable[[Path], None],
    keys: list[str | None],
    keyed: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 48: with the manifest gone and every weight_scale tripled, verify with the key set said OK, judging
    the artifact as a checkpoint ditq did not write."""
    from safetensors.torch import load_file, save_file

    out = tmp_path / "artifact"
    shutil.copytree(keyed[1], out, symlinks=True)
    weights = out / "transformer" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(weights)
    save_file({k: v * 3 if k.endswith("weight_scale") else v for k, v in tensors.items()}, weights)
    drop(out)
    for key in keys:
        report = _verify_with(key, out, monkeypatch)
        assert not report.ok and report.checks[0].name == "manifest", report.table()
        assert main(["verify", str(out)]) == 1
        assert "OK" not in capsys.readouterr().out.splitlines()[-1]
    if keys == [KEY]:  # without a key, a folder with no trace of ditq is a checkpoint of another tool's
        monkeypatch.delenv(SEAL_KEY_ENV)
        assert verify(out).checks[0].status == "n/a"


def test_any_bytes_are_a_key(
    keyed: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 48: a key that is not UTF-8 gave a UnicodeEncodeError traceback in quantize and verify."""
    source, _ = keyed
    monkeypatch.delenv(SEAL_KEY_ENV, raising=False)
    monkeypatch.setitem(os.environb, SEAL_KEY_ENV.encode(), b"\xff\xfe not text \x80")
    assert main(["quantize", str(source), str(tmp_path / "out"), "--scheme", "w8a8"]) == 0
    report = verify(tmp_path / "out")
    assert report.ok and _key_row(report)[0] == "pass"
    monkeypatch.setitem(os.environb, SEAL_KEY_ENV.encode(), b"\xff\xfe another")
    assert _key_row(verify(tmp_path / "out"))[0] == "fail"
