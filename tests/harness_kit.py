"""Shared pieces of the probe, judge, output and adversarial tests: a tiny fixture set on disk, a live stub server,
probe runs, a folder of a person's own.

Their fixtures (``fixture_set``, ``stub``) are registered by ``tests/probe/conftest.py`` and
``tests/judge/conftest.py``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from stub_images_server import StubServer

from ditq.runfiles import ProbeRecord, Structure

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent
# Unedited copies of the seed probe's files (data/harness/README.md says which), so no test needs the seed itself.
SEED_EVIDENCE_COPY = HERE / "data" / "harness" / "seed-rtx3090"
SEED_FIXTURES_COPY = HERE / "data" / "harness" / "seed-fixtures.json"

# Three fixtures, 0/1/2 references, tiny sizes (multiples of 16).
FIXTURES = {
    "gen-one": {"mode": "generate", "references": [], "width": 32, "height": 48, "prompt": "a lighthouse"},
    "edit-one": {
        "mode": "edit",
        "references": ["ref-a"],
        "width": 48,
        "height": 32,
        "prompt": "make it dusk",
        "negative_prompt": None,
    },
    "edit-two": {
        "mode": "edit",
        "references": ["ref-a", "ref-b"],
        "width": 32,
        "height": 32,
        "prompt": "put both together",
        "negative_prompt": "blur",
    },
}


@pytest.fixture
def fixture_set(tmp_path: Path) -> tuple[Path, Path]:
    """(fixtures.json, refs dir) for FIXTURES, with seeded reference PNGs."""
    return write_fixture_set(tmp_path)


def write_fixture_set(tmp_path: Path) -> tuple[Path, Path]:
    refs = tmp_path / "refs"
    refs.mkdir()
    rng = np.random.default_rng(7)
    for name in ("ref-a", "ref-b"):
        Image.fromarray(rng.integers(0, 256, size=(16, 16, 3), dtype=np.uint8), "RGB").save(
            refs / f"{name}.png"
        )
    path = tmp_path / "fixtures.json"
    path.write_text(json.dumps(FIXTURES))
    return path, refs


@pytest.fixture
def stub() -> Iterator[StubServer]:
    with StubServer() as server:
        yield server


def probe_argv(
    url: str, fixture_set: tuple[Path, Path], out: Path, *extra: str, seeds: str = "1-4"
) -> list[str]:
    """``ditq probe``'s command line over the tiny fixture set (4 steps, no progress bar), ``extra`` last."""
    fixtures, refs = fixture_set
    return [
        "probe",
        "--endpoint",
        url,
        "--fixtures",
        str(fixtures),
        "--refs",
        str(refs),
        "--seeds",
        seeds,
        "--steps",
        "4",
        "--out",
        str(out),
        "--no-progress",
        *extra,
    ]


def probe_run(
    url: str | list[str], fixture_set: tuple[Path, Path], out: Path, seeds: list[int], **options: object
):
    """run_probe over the tiny fixture set, no progress bar; returns the ProbeSummary."""
    from ditq.probe.runner import ProbeOptions, run_probe

    endpoints = [url] if isinstance(url, str) else url
    fixtures, refs = fixture_set
    return run_probe(
        ProbeOptions(
            endpoints=endpoints,
            fixtures=fixtures,
            refs=refs,
            seeds=seeds,
            out=out,
            steps=4,
            progress=False,
            memory_interval_s=0.2,
            **options,
        )  # type: ignore[arg-type]
    )


def served_record(
    fixture_id: str, seed: int, structure: Structure | None = None, **fields: object
) -> ProbeRecord:
    """A records.jsonl line as the probe writes it for a request its server answered with an image."""
    values: dict[str, object] = {
        "fixture_id": fixture_id,
        "seed": seed,
        "n_references": 0,
        "steps": 4,
        "true_cfg_scale": 1.0,
        "size": "32x32",
        "endpoint": "http://127.0.0.1:9000",
        "offload": "none",
        "invocation": 0,
        "t_start": 1000.0,
        "t_end": 1001.0,
        "wall_s": 1.0,
        "http": 200,
        "bytes": 100,
        "sha256": "0" * 64,
        "structure": structure,
        "usage": None,
        "metrics": None,
        "error": None,
        "error_code": None,
        "peak_memory_mib": None,
        **fields,
    }
    return ProbeRecord.model_validate(values)


def mine(folder: Path) -> Path:
    """A folder of a person's own: files ditq did not write, which no command may delete or write into."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "notes.txt").write_text("a person's notes")
    (folder / "keep").mkdir(exist_ok=True)
    (folder / "keep" / "data.bin").write_bytes(b"\x00\x01")
    return folder
