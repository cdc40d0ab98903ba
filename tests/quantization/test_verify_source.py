"""verify --source holds every file of the artifact to the source's, not only the quantized tensors.

Issue 28, item 2: each tampering below, re-sealed with recomputed digests as a forger would, passed
``verify --source``; its images were 3-11 dB from the genuine artifact's.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file, save_file
from tiny_models import make_model_dir

import ditq
from ditq.checkpoint.manifest import file_records, read_manifest, source_tree_digest, write_manifest
from ditq.checkpoint.source_tree import scan_tree
from ditq.quantization.verifier import verify


@pytest.fixture(scope="module")
def genuine(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(source, artifact): the tiny Flux pipeline with a T5 encoder, its transformer quantized, the rest linked.
    Shared: copy it before changing it."""
    folder = tmp_path_factory.mktemp("verify-source")
    source = make_model_dir(folder, "flux", text_encoder=True)
    out = folder / "artifact"
    ditq.quantize(source, out, "w8a8", components=["transformer"], link=True)  # absolute: copied elsewhere
    return source, out


def _reseal(out: Path) -> None:
    """Recompute every digest the manifest holds, the links' targets and what is behind them included."""
    manifest = read_manifest(out)
    manifest["linked"] = {
        n: str(p.readlink()) for n, p in sorted((p.name, p) for p in out.iterdir()) if p.is_symlink()
    }
    behind: dict[str, Any] = {}
    for name, target in manifest["linked"].items():
        _, records = source_tree_digest(
            scan_tree(out / target, follow_links=True)
        )  # relative to the artifact
        behind.update({f"{name}/{rel}": record for rel, record in records.items()})
    manifest["source_files"] = behind
    manifest["files"] = file_records(out, skip_dirs=set(manifest["linked"]))
    write_manifest(out, manifest)


def _copy_in(out: Path, name: str) -> Path:
    """The linked entry ``name`` replaced by a copy of what it links to."""
    target = (out / name).resolve()
    (out / name).unlink()
    shutil.copytree(target, out / name)
    return out / name


def _zero_weights(folder: Path) -> None:
    path = folder / "model.safetensors"
    tensors = {name: tensor.zero_() for name, tensor in load_file(str(path)).items()}
    save_file(tensors, str(path), metadata={"format": "pt"})


def _edit_json(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    document = json.loads(path.read_text())
    edit(document)
    path.unlink()  # a copied file may be read-only; a forger replaces it
    path.write_text(json.dumps(document, indent=2))


def _zeroed_text_encoder_copied(out: Path, source: Path, elsewhere: Path) -> None:
    _zero_weights(_copy_in(out, "text_encoder"))


def _zeroed_text_encoder_relinked(out: Path, source: Path, elsewhere: Path) -> None:
    shutil.copytree(source / "text_encoder", elsewhere)
    _zero_weights(elsewhere)
    (out / "text_encoder").unlink()
    (out / "text_encoder").symlink_to(elsewhere, target_is_directory=True)


def _transformer_architecture_changed(out: Path, source: Path, elsewhere: Path) -> None:
    # the same tensors, another rotary split of the heads
    _edit_json(out / "transformer/config.json", lambda c: c.update(axes_dims_rope=[6, 4, 6]))


def _scheduler_shift_7(out: Path, source: Path, elsewhere: Path) -> None:
    _edit_json(_copy_in(out, "scheduler") / "scheduler_config.json", lambda c: c.update(shift=7.0))


def _model_index_edited(out: Path, source: Path, elsewhere: Path) -> None:
    _edit_json(out / "model_index.json", lambda index: index.update(_diffusers_version="0.0.1"))


# tampering -> (the failed check, what its detail says)
TAMPERING = {
    "zeroed text encoder, copied": (
        _zeroed_text_encoder_copied,
        "text_encoder: source files",
        "text_encoder/model.safetensors: differs from the source's",
    ),
    "zeroed text encoder, re-linked": (
        _zeroed_text_encoder_relinked,
        "text_encoder: source files",
        "text_encoder: a link to {elsewhere}, not to {source}/text_encoder",
    ),
    "transformer architecture config": (
        _transformer_architecture_changed,
        "transformer: source config",
        "transformer/config.json differs from the source's in axes_dims_rope",
    ),
    "scheduler shift 7": (
        _scheduler_shift_7,
        "scheduler: source files",
        "scheduler/scheduler_config.json: differs from the source's",
    ),
    "model_index.json edited": (
        _model_index_edited,
        "model_index: source",
        "model_index.json differs from the source's in _diffusers_version",
    ),
}


@pytest.mark.parametrize("what", sorted(TAMPERING))
def test_resealed_tampering_fails_against_the_source(
    what: str, genuine: tuple[Path, Path], tmp_path: Path
) -> None:
    source, shared = genuine
    out, elsewhere = tmp_path / "artifact", tmp_path / "elsewhere"
    shutil.copytree(shared, out, symlinks=True)
    tamper, check, message = TAMPERING[what]
    tamper(out, source, elsewhere)
    _reseal(out)
    assert verify(out).ok  # self-consistent and sealed: only the source can tell
    report = verify(out, source)
    failed = {c.name: c.detail for c in report.checks if not c.ok}
    assert list(failed) == [check], report.table()
    expected = message.format(elsewhere=elsewhere.resolve(), source=source.resolve())
    assert expected in failed[check] and "\n" not in failed[check], failed[check]


def test_the_genuine_artifact_passes_linked_or_copied(genuine: tuple[Path, Path], tmp_path: Path) -> None:
    source, shared = genuine
    report = verify(shared, source)
    assert report.ok, report.table()
    rows = {c.name: c.detail for c in report.checks}
    assert rows["text_encoder: source files"] == f"a link to {source}/text_encoder"
    assert rows["transformer: source config"].startswith(
        "config.json the source's but for quantization_config"
    )
    assert {"model_index: source", "scheduler: source files"} <= set(rows)
    out = tmp_path / "artifact"  # the same files copied in instead of linked: still the source's
    shutil.copytree(shared, out, symlinks=True)
    for name in ("text_encoder", "scheduler"):
        _copy_in(out, name)
    _reseal(out)
    report = verify(out, source)
    assert report.ok, report.table()
    assert report.checks[
        [c.name for c in report.checks].index("text_encoder: source files")
    ].detail.startswith("a copy: 2 files byte-identical")


def test_a_fifo_among_copied_files_is_one_failed_row(genuine: tuple[Path, Path], tmp_path: Path) -> None:
    source, shared = genuine
    out = tmp_path / "artifact"
    shutil.copytree(shared, out, symlinks=True)
    os.mkfifo(_copy_in(out, "scheduler") / "notes.txt")  # nothing may block on reading it
    (row,) = [c for c in verify(out, source).checks if c.name == "scheduler: source files"]
    assert (
        not row.ok
        and f"{out.resolve()}/scheduler/notes.txt: not a regular file or folder (a FIFO)" in row.detail
    )
