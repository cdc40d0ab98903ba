"""Movable artifacts: the entries an artifact does not rewrite are relative links where the source is beside it,
else copies (small) or absolute links (large); a moved artifact loads and verifies, a broken link is named."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

import ditq
from ditq.checkpoint.manifest import read_manifest
from ditq.demo import default_model_dir
from ditq.errors import InputError
from ditq.quantization.links import ABSOLUTE, COPY, is_beside, plan_entries

DEMO_ENTRIES = ["scheduler", "text_encoder"]  # what quantizing the demo's transformer leaves as it is


@pytest.mark.parametrize(
    ("source", "output", "beside"),
    [
        ("/w/models/qwen", "/w/models/qwen-w8a8", True),  # siblings
        ("/w/models/qwen", "/w/artifacts/qwen-w8a8", True),  # cousins: their grandparent holds both
        ("/w/hub/org/snapshots/abc", "/w/out", True),  # the source may lie deep under the shared folder
        ("/w/qwen", "/w/sweep/fp8/artifact", False),  # the shared folder is three levels up
        ("/qwen", "/out", False),  # the only folder holding both is the filesystem root
    ],
)
def test_beside_means_within_the_artifacts_parent_or_grandparent(
    source: str, output: str, beside: bool
) -> None:
    assert is_beside(Path(source), Path(output)) is beside


def test_link_and_copy_choose_every_entry(tmp_path: Path) -> None:
    source = default_model_dir()
    beside = source.parent / "demo-w8a8"  # not written: the plan only reads the source's sizes
    assert {e.how for e in plan_entries(source, beside, DEMO_ENTRIES, "link")} == {ABSOLUTE}
    assert {e.how for e in plan_entries(source, tmp_path / "out", DEMO_ENTRIES, "copy")} == {COPY}
    with pytest.raises(InputError, match="--link and --copy are mutually exclusive"):
        ditq.quantize(source, tmp_path / "out", "w8a8", link=True, copy=True)


def test_an_artifact_moved_with_its_source_loads_and_verifies(tmp_path: Path) -> None:
    shutil.copytree(default_model_dir(), tmp_path / "models" / "demo")
    ditq.quantize(tmp_path / "models" / "demo", tmp_path / "models" / "demo-w8a8", "w8a8", device="cpu")
    assert read_manifest(tmp_path / "models" / "demo-w8a8")["linked"] == {
        name: f"../demo/{name}" for name in DEMO_ENTRIES
    }
    moved = tmp_path / "elsewhere" / "models"
    shutil.move(tmp_path / "models", moved)
    out = moved / "demo-w8a8"
    assert ditq.load_pipeline(out, device="cpu").text_encoder is not None
    report = ditq.verify(out, moved / "demo")
    assert report.ok, report.table()

    alone = shutil.move(
        out, tmp_path / "demo-w8a8"
    )  # without its source: each link is named, with its target
    (files,) = [c for c in ditq.verify(alone).checks if c.name == "files"]
    assert not files.ok and "\n" not in files.detail
    assert "broken link scheduler -> ../demo/scheduler: nothing at " in files.detail
    with pytest.raises(
        InputError, match=r"demo-w8a8/scheduler: a broken link to \.\./demo/scheduler \(nothing at"
    ):
        ditq.load_pipeline(alone, device="cpu")


def test_an_artifact_not_beside_its_source_copies_small_entries_and_links_large_ones(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = shutil.copytree(default_model_dir(), tmp_path / "models" / "demo")
    out = tmp_path / "runs" / "one" / "demo-w8a8"  # three folders up to one that holds the source
    limit = 10_000  # the demo's scheduler (under 1 kB) is small, its text encoder (0.6 MB) large
    with caplog.at_level(logging.WARNING, logger="ditq.quantization.links"):
        ditq.quantize(source, out, "w8a8", device="cpu", copy_max_bytes=limit)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.startswith(f"{out}/text_encoder: a link to {source.resolve()}/text_encoder (")
    manifest = read_manifest(out)
    assert manifest["linked"] == {"text_encoder": f"{source.resolve()}/text_encoder"}
    assert "scheduler/scheduler_config.json" in manifest["files"]  # copied: its digest is the artifact's own
    assert manifest["options"]["links"] == "auto" and manifest["options"]["copy_max_bytes"] == limit

    moved = shutil.move(
        out, tmp_path / "demo-w8a8"
    )  # alone: the copy goes with it, the absolute link still holds
    assert not (moved / "scheduler").is_symlink()
    assert ditq.load_pipeline(moved, device="cpu").scheduler is not None
    report = ditq.verify(moved, source)
    assert report.ok, report.table()
