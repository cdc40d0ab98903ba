"""Quantize against hostile or unlucky sources: it reads only its source tree, publishes nothing more readable
than the source, takes one lock per output, and turns every malformed input into one line with exit 2."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import ditq
import ditq.quantization.quantizer as quantizer
from ditq.checkpoint import safetensors_io
from ditq.checkpoint.manifest import read_manifest
from ditq.checkpoint.safetensors_io import MAX_HEADER_BYTES, MAX_TENSORS_PER_FILE, read_header
from ditq.cli import main
from ditq.errors import InputError
from ditq.fsutil import sha256_file

SECRET = b"not for the artifact\n"


def _outside_secret(tmp_path: Path) -> Path:
    secret = tmp_path / "elsewhere" / "secret.txt"
    secret.parent.mkdir()
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    return secret


def _only(tmp_path: Path, *names: str) -> list[str]:
    """What is left in tmp_path, less the names given (a refused run must leave nothing)."""
    return sorted(p.name for p in tmp_path.iterdir() if p.name not in names)


# Case 6: confinement to the source tree.


def test_link_out_of_the_source_is_refused_unless_followed(model_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    source = model_dir("flux")
    secret = _outside_secret(tmp_path)
    (source / "transformer" / "notes.txt").symlink_to(secret)
    with pytest.raises(
        InputError, match=r"transformer/notes.txt: a symbolic link to .*secret.txt, outside"
    ) as info:
        ditq.quantize(source, tmp_path / "out", "w8a8")
    assert "\n" not in str(info.value)
    assert _only(tmp_path, source.parent.name, "elsewhere") == []

    out = ditq.quantize(source, tmp_path / "out", "w8a8", follow_links=True).path
    copied = out / "transformer" / "notes.txt"
    assert copied.read_bytes() == SECRET and not copied.is_symlink()
    assert stat.S_IMODE(copied.stat().st_mode) == 0o600  # it was 0644 before: wider than the source
    manifest = read_manifest(out)
    assert manifest["options"]["follow_links"] is True
    assert manifest["source_files"]["transformer/notes.txt"] == {
        "sha256": hashlib.sha256(SECRET).hexdigest(),
        "size": len(SECRET),
    }
    assert manifest["inputs"]["files"] == len(manifest["source_files"]) == 5
    assert ditq.verify(out, source).ok


def test_copy_of_a_component_linked_from_elsewhere_needs_follow_links(model_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    source = model_dir("flux")
    elsewhere = tmp_path / "elsewhere-scheduler"
    shutil.move(source / "scheduler", elsewhere)
    (source / "scheduler").symlink_to(elsewhere, target_is_directory=True)
    for copy in (True, False):
        with pytest.raises(
            InputError, match=r"/scheduler: a symbolic link to .*elsewhere-scheduler, outside"
        ):
            ditq.quantize(source, tmp_path / "out", "w8a8", copy=copy)
    assert not (tmp_path / "out").exists()

    out = ditq.quantize(source, tmp_path / "out", "w8a8", copy=True, follow_links=True).path
    config = "scheduler/scheduler_config.json"
    assert (out / config).read_bytes() == (elsewhere / "scheduler_config.json").read_bytes()
    digest = hashlib.sha256((elsewhere / "scheduler_config.json").read_bytes()).hexdigest()
    manifest = read_manifest(out)
    assert manifest["source_files"][config]["sha256"] == digest == manifest["files"][config]["sha256"]
    assert ditq.verify(out).ok


@pytest.mark.parametrize("where", ["../../outside.safetensors", "absolute"])
def test_shard_index_naming_a_path_out_of_the_component_is_refused(
    where: str, model_dir, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    source = model_dir("flux", shards=2)
    transformer = source / "transformer"
    outside = source.parent / "outside.safetensors"  # a real weights file: the old code quantized it
    shutil.move(transformer / "diffusion_pytorch_model-00002-of-00002.safetensors", outside)
    named = str(outside) if where == "absolute" else where
    index_path = transformer / "diffusion_pytorch_model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"] = {k: (v if "00001" in v else named) for k, v in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))
    with pytest.raises(InputError, match=r"weight_map names .*, not a file inside") as info:
        ditq.quantize(source, tmp_path / "out", "w8a8")
    assert str(index_path) in str(info.value)
    assert _only(tmp_path, source.parent.name) == []


def test_output_permissions_never_wider_than_the_source(model_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    source = model_dir("flux", text_encoder=True)
    (source / "transformer" / "config.json").chmod(0o600)
    (source / "text_encoder" / "config.json").chmod(0o640)
    (source / "scheduler" / "scheduler_config.json").chmod(0o600)
    (source / "model_index.json").chmod(0o644)
    for weights in (source / "transformer").glob("*.safetensors"):
        weights.chmod(0o600)
    out = ditq.quantize(source, tmp_path / "out", "w8a8", copy=True).path
    modes = {
        p.relative_to(out).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in out.rglob("*") if p.is_file()
    }
    assert modes["transformer/config.json"] == 0o600
    assert modes["transformer/diffusion_pytorch_model.safetensors"] == 0o600
    assert modes["text_encoder/config.json"] == 0o640
    assert modes["scheduler/scheduler_config.json"] == 0o600
    assert modes["model_index.json"] == modes["MANIFEST.json"] == 0o644
    for rel, mode in modes.items():
        if (source / rel).exists():
            assert mode & ~stat.S_IMODE((source / rel).stat().st_mode) == 0, rel


def _as_hub_snapshot(model: Path, cache: Path) -> Path:
    """Lay ``model`` out as a hub cache does: every file a relative link into the repository's blobs/."""
    repo = cache / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    shutil.copytree(model, snapshot)
    for path in sorted(p for p in snapshot.rglob("*") if p.is_file()):
        blob = repo / "blobs" / hashlib.sha256(path.read_bytes()).hexdigest()
        shutil.move(path, blob)
        path.symlink_to(os.path.relpath(blob, path.parent))
    return snapshot


def test_hub_snapshot_links_into_its_blobs_are_inside(model_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    snapshot = _as_hub_snapshot(model_dir("flux"), tmp_path / "hub")
    out = ditq.quantize(snapshot, tmp_path / "out", "w8a8").path
    manifest = read_manifest(out)
    # a folder given by its path records no hub id: its name proves nothing (only an id resolved by ditq does)
    assert (manifest["inputs"]["hub_id"], manifest["inputs"]["revision"]) == (None, None)
    config = snapshot / "scheduler" / "scheduler_config.json"
    assert manifest["source_files"]["scheduler/scheduler_config.json"]["sha256"] == config.resolve().name
    assert ditq.verify(out, snapshot).ok


# Case 8: where the output goes, and one writer at a time.


def test_output_through_a_link_into_the_source_is_refused(model_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    source = model_dir("wan")
    link = tmp_path / "link-to-source"
    link.symlink_to(source, target_is_directory=True)
    before = sorted(p.name for p in source.iterdir())
    with pytest.raises(InputError, match="the output is inside the input"):
        ditq.quantize(source, link / "out", "w8a8")
    with pytest.raises(InputError, match="the output holds the input"):
        ditq.quantize(source, source.parent, "w8a8", force=True)  # --force would have deleted the source
    assert sorted(p.name for p in source.iterdir()) == before


def test_a_second_run_on_one_output_is_refused_and_the_first_survives(
    model_dir, tmp_path: Path, monkeypatch, capsys
) -> None:  # type: ignore[no-untyped-def]
    """The second run starts while the first one's temporary directory is live: before the lock, its sweep of
    leftovers deleted that directory."""
    source, out = model_dir("flux"), tmp_path / "out"
    original = quantizer._link_the_rest
    seen: dict[str, object] = {}

    def second_run_meanwhile(src: Path, tmp: Path, *args: object) -> dict[str, str]:
        if not seen:  # once: a second run that is let through gets here too
            seen["code"] = None
            seen["code"] = main(["quantize", str(source), str(out)])
            seen["stderr"] = capsys.readouterr().err.strip().splitlines()
            seen["tmp_alive"] = tmp.is_dir() and (tmp / "transformer").is_dir()
        return original(src, tmp, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(quantizer, "_link_the_rest", second_run_meanwhile)
    ditq.quantize(source, out, "w8a8")
    assert seen["code"] == 2 and seen["tmp_alive"] is True
    stderr = seen["stderr"]
    assert isinstance(stderr, list) and len(stderr) == 1
    assert f"{out}: another ditq quantize is writing it" in stderr[0]
    assert ditq.verify(out, source).ok
    assert _only(tmp_path, source.parent.name) == ["out"]  # the lock file is gone too


# Case 9: malformed input is one line and exit 2, without a hang, a traceback or a misleading message.


def _header_doc(path: Path) -> tuple[dict[str, object], bytes]:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length]), data[8 + length :]


def _write_with_header(path: Path, doc: dict[str, object], body: bytes) -> None:
    header = json.dumps(doc).encode()
    header += b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header + body)


def _fifo(source: Path) -> Path:
    weights = source / "transformer" / "diffusion_pytorch_model.safetensors"
    weights.unlink()
    os.mkfifo(weights)
    return weights


def _bad_metadata(source: Path) -> Path:
    weights = source / "transformer" / "diffusion_pytorch_model.safetensors"
    doc, body = _header_doc(weights)
    _write_with_header(weights, {**doc, "__metadata__": ["format", "pt"]}, body)
    return weights


def _mistyped_config(source: Path) -> Path:
    config = source / "transformer" / "config.json"
    doc = json.loads(config.read_text())
    config.write_text(json.dumps({**doc, "num_layers": "one"}))
    return config


def _directory_as_weights(source: Path) -> Path:
    weights = source / "transformer" / "diffusion_pytorch_model.safetensors"
    weights.unlink()
    weights.mkdir()
    return weights


def _write_many_tensors(weights: Path) -> Path:
    """A valid file of MAX_TENSORS_PER_FILE + 1 empty tensors (about 5 MB; the issue's had 1 000 000)."""
    entries = ",".join(
        f'"t{i}":{{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}' for i in range(MAX_TENSORS_PER_FILE + 1)
    )
    header = f"{{{entries}}}".encode()
    header += b" " * (-len(header) % 8)
    weights.write_bytes(struct.pack("<Q", len(header)) + header)
    return weights


def _too_many_tensors(source: Path) -> Path:
    return _write_many_tensors(source / "transformer" / "diffusion_pytorch_model.safetensors")


HOSTILE: dict[str, tuple[Callable[[Path], Path], str]] = {
    "fifo as weights": (_fifo, "not a regular file or folder (a FIFO)"),
    "metadata not an object": (_bad_metadata, "__metadata__ is not an object of strings"),
    "mistyped config field": (_mistyped_config, "cannot build a FluxTransformer2DModel from it (TypeError"),
    "directory as weights": (_directory_as_weights, "not a regular file (a directory)"),
    "too many tensors": (_too_many_tensors, f"more than the {MAX_TENSORS_PER_FILE} tensors ditq reads"),
}


@pytest.mark.parametrize("how", sorted(HOSTILE))
def test_hostile_source_is_one_line_exit_2(how: str, model_dir, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    source = model_dir("flux")
    spoil, message = HOSTILE[how]
    named = spoil(source)
    assert main(["quantize", str(source), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ditq quantize: error:"), err
    assert str(named) in err[0] and message in err[0], err[0]
    assert _only(tmp_path, source.parent.name) == []


def test_fifo_is_refused_by_every_reader(tmp_path: Path) -> None:
    """Not only the source scan: a FIFO reached by verify or by a header read is refused at open, not read."""
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(InputError, match="not a regular file"):
        read_header(fifo)
    with pytest.raises(InputError, match="not a regular file"):
        sha256_file(fifo)


def test_header_bounds_are_checked_before_parsing(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    def no_parse(*args: object, **kwargs: object) -> object:
        raise AssertionError("the header was parsed")

    monkeypatch.setattr(safetensors_io.json, "loads", no_parse)
    too_many = _write_many_tensors(tmp_path / "many.safetensors")
    with pytest.raises(InputError, match=f"lists more than the {MAX_TENSORS_PER_FILE} tensors"):
        read_header(too_many)
    too_long = tmp_path / "long.safetensors"
    with open(too_long, "wb") as handle:  # a sparse file: the declared header is there, and never read
        handle.write(struct.pack("<Q", MAX_HEADER_BYTES + 8))
        handle.truncate(MAX_HEADER_BYTES + 64)
    with pytest.raises(
        InputError, match=f"header of {MAX_HEADER_BYTES + 8} bytes, over the {MAX_HEADER_BYTES}"
    ):
        read_header(too_long)


def test_empty_tensors_pass_through(model_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    source = model_dir("flux", shards=2)
    shard = source / "transformer" / "diffusion_pytorch_model-00001-of-00002.safetensors"
    tensors = load_file(str(shard))
    tensors["empty"] = torch.zeros(0, dtype=torch.bfloat16)
    tensors["empty_rows"] = torch.zeros(3, 0, dtype=torch.bfloat16)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index_path = source / "transformer" / "diffusion_pytorch_model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"].update(empty=shard.name, empty_rows=shard.name)
    index_path.write_text(json.dumps(index))
    out = ditq.quantize(source, tmp_path / "out", "w8a8").path
    stored = load_file(str(out / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert stored["empty"].shape == (0,) and stored["empty_rows"].shape == (3, 0)
    assert stored["transformer_blocks.0.attn.to_q.weight"].dtype == torch.int8
    # Tensors the model has no place for are copied as they are, and verify says what the loader says of them.
    failed = {c.name: c.detail for c in ditq.verify(out, source).checks if not c.ok}
    assert list(failed) == ["transformer: tensors"]
    assert "tensor 'empty' has no place in FluxTransformer2DModel" in failed["transformer: tensors"]


def test_verify_names_a_mistyped_config_field(artifact) -> None:  # type: ignore[no-untyped-def]
    _, out = artifact("flux", "w8a8")
    _mistyped_config(out)
    report = ditq.verify(out)
    failed = {c.name: c.detail for c in report.checks if not c.ok}
    assert "transformer/config.json: cannot build a FluxTransformer2DModel" in failed["transformer: tensors"]
    assert "altered transformer/config.json" in failed["files"]
