"""The baseline is sealed; gate and compare refuse it unsealed or altered unless told otherwise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from stub_images_server import StubServer

from ditq.errors import DitqError
from ditq.judge.baseline import BaselineOptions, make_baseline, require_sealed, seal_run, verify_seal
from ditq.probe.records import is_success, read_records


def _baseline(url: str, fixture_set, out: Path) -> None:
    fixtures, refs = fixture_set
    make_baseline(
        BaselineOptions(
            model=Path("bf16-model"),
            fixtures=fixtures,
            refs=refs,
            out=out,
            seeds=[1, 2],
            steps=4,
            endpoint=url,
            progress=False,
        )
    )


def test_endpoint_baseline_is_sealed(tmp_path: Path, fixture_set, stub: StubServer) -> None:
    out = tmp_path / "baseline"
    _baseline(stub.url, fixture_set, out)
    seal = json.loads((out / "SEAL.json").read_text())
    run = json.loads((out / "RUN.json").read_text())
    assert run["kind"] == "baseline" and run["model"] == "bf16-model"
    assert seal["fixture_digest"] == run["fixture_digest"] and "ditq" in seal["versions"]
    assert len([k for k in seal["files"] if k.startswith("images/")]) == 6
    assert {"records.jsonl", "RUN.json"} <= set(seal["files"])
    assert all(is_success(r) for r in read_records(out)) and verify_seal(out) == []
    assert require_sealed(out, allow_unsealed=False) == "sealed"


@pytest.mark.parametrize("tamper", ["image-bytes", "extra-image", "deleted-image", "records", "no-seal"])
def test_altered_baseline_is_refused(tmp_path: Path, fixture_set, stub: StubServer, tamper: str) -> None:
    out = tmp_path / "baseline"
    _baseline(stub.url, fixture_set, out)
    image = out / "images" / "edit-one.s1.png"
    if tamper == "image-bytes":
        data = bytearray(image.read_bytes())
        data[-20] ^= 0xFF
        image.write_bytes(bytes(data))
    elif tamper == "extra-image":
        (out / "images" / "edit-one.s9.png").write_bytes(image.read_bytes())
    elif tamper == "deleted-image":
        image.unlink()
    elif tamper == "records":
        with open(out / "records.jsonl", "a") as handle:
            handle.write("{}\n")
    else:
        (out / "SEAL.json").unlink()
    problems = verify_seal(out)
    assert len(problems) == 1
    with pytest.raises(DitqError, match="refusing it"):
        require_sealed(out, allow_unsealed=False)
    assert require_sealed(out, allow_unsealed=True).startswith("unsealed (allowed)")


def test_resealing_after_a_change_is_explicit(tmp_path: Path, fixture_set, stub: StubServer) -> None:
    out = tmp_path / "baseline"
    _baseline(stub.url, fixture_set, out)
    (out / "images" / "gen-one.s2.png").unlink()
    assert verify_seal(out)
    seal_run(out)
    assert verify_seal(out) == []
