"""compare: PSNR / SSIM rows against a sealed baseline, missing and error rows, the parity band."""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import shutil
from pathlib import Path

import pytest
from harness_kit import probe_run, write_fixture_set
from PIL import Image
from stub_images_server import StubServer, StubState

from ditq.commands import compare as compare_command
from ditq.errors import DitqError
from ditq.judge.baseline import seal_run
from ditq.judge.compare import PSNR_CAP_DB, ParityBand, compare_run, parity_from_pair


def _compare_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    compare_command.add_arguments(parser)
    return compare_command.run(parser.parse_args(list(argv)))


@pytest.fixture(scope="module")
def built_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """baseline (sealed), same (identical server), dim (RGB x0.9) and dark (RGB x0.5); seeds 1-2."""
    root = tmp_path_factory.mktemp("compare")
    fixture_set = write_fixture_set(root)
    with StubServer() as server:
        probe_run(server.url, fixture_set, root / "baseline", [1, 2])
        probe_run(server.url, fixture_set, root / "same", [1, 2])
    for name, factor in (("dim", 0.9), ("dark", 0.5)):
        with StubServer(StubState(dim=factor)) as server:
            probe_run(server.url, fixture_set, root / name, [1, 2])
    seal_run(root / "baseline")
    return root


@pytest.fixture
def runs(built_runs: Path, tmp_path: Path) -> dict[str, Path]:
    """A private copy of the built runs, free to alter."""
    names = ("baseline", "same", "dim", "dark")
    for name in names:
        shutil.copytree(built_runs / name, tmp_path / name)
    return {name: tmp_path / name for name in names}


def _rerecord(run: Path, fixture_id: str, seed: int) -> None:
    """The record of ``fixture_id`` seed ``seed`` names its image as it now is (as if the server had sent it)."""
    data = (run / "images" / f"{fixture_id}.s{seed}.png").read_bytes()
    lines = [json.loads(line) for line in (run / "records.jsonl").read_text().splitlines()]
    for line in lines:
        if (line["fixture_id"], line["seed"]) == (fixture_id, seed):
            line.update(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
    (run / "records.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_identical_and_degraded_runs(runs: dict[str, Path]) -> None:
    same = compare_run(runs["same"], runs["baseline"])
    assert same.overall.ok == same.overall.n == 6
    assert all(r.psnr_db == PSNR_CAP_DB and r.ssim == pytest.approx(1.0) for r in same.rows)
    assert all(r.space == "RGBA" for r in same.rows)
    if importlib.util.find_spec("lpips") is None:
        assert same.lpips_note == "lpips skipped: the lpips package is not installed"
        assert all(r.lpips is None for r in same.rows)
    else:
        assert same.lpips_note.startswith("lpips")  # used, or skipped for want of local weights, and said so
    dim, dark = compare_run(runs["dim"], runs["baseline"]), compare_run(runs["dark"], runs["baseline"])
    for fixture_id in ("gen-one", "edit-one", "edit-two"):
        d, k = dim.fixtures[fixture_id], dark.fixtures[fixture_id]
        assert d.psnr_db.min is not None and d.psnr_db.mean is not None and d.psnr_db.max is not None
        assert k.psnr_db.mean is not None and d.ssim.mean is not None and k.ssim.mean is not None
        assert d.psnr_db.min <= d.psnr_db.mean <= d.psnr_db.max
        assert PSNR_CAP_DB > d.psnr_db.mean > k.psnr_db.mean > 0
        assert 1.0 > d.ssim.mean > k.ssim.mean


def test_missing_image_and_size_mismatch_rows(runs: dict[str, Path]) -> None:
    (runs["dim"] / "images" / "edit-one.s1.png").unlink()
    Image.new("RGBA", (16, 16)).save(runs["dim"] / "images" / "edit-two.s2.png")
    _rerecord(runs["dim"], "edit-two", 2)
    result = compare_run(runs["dim"], runs["baseline"])
    rows = {(r.fixture_id, r.seed): r for r in result.rows}
    assert rows[("edit-one", 1)].status == "missing"
    assert rows[("edit-two", 2)].status == "error"
    assert "size 16x16 vs baseline 32x32" in (rows[("edit-two", 2)].error or "")
    assert result.fixtures["edit-one"].missing == 1 and result.fixtures["edit-two"].errors == 1
    assert result.overall.ok == 4


def test_rgb_candidate_is_composited_over_white(runs: dict[str, Path]) -> None:
    path = runs["same"] / "images" / "gen-one.s1.png"
    with Image.open(path) as image:
        image.convert("RGB").save(path)  # opaque source: over white it is the same picture
    _rerecord(runs["same"], "gen-one", 1)
    row = next(
        r
        for r in compare_run(runs["same"], runs["baseline"]).rows
        if r.fixture_id == "gen-one" and r.seed == 1
    )
    assert row.space == "RGB over white" and row.psnr_db == PSNR_CAP_DB


def test_parity_band_stated_and_from_a_pair(runs: dict[str, Path]) -> None:
    dim = compare_run(runs["dim"], runs["baseline"])
    level = dim.overall.psnr_db.mean
    assert level is not None
    inside = compare_run(runs["dim"], runs["baseline"], parity=ParityBand("stated", level - 2, {}, 1.0))
    outside = compare_run(runs["dim"], runs["baseline"], parity=ParityBand("stated", level + 30, {}, 1.0))
    assert inside.parity is not None and inside.parity.inside
    assert outside.parity is not None and not outside.parity.inside
    decisions = [e.parity for e in outside.fixtures.values() if e.parity is not None]
    assert len(decisions) == 3 and all(d.decision == "outside" and d.reference == "stated" for d in decisions)
    assert all(d.high_db is not None and d.high_db < d.floor_db == -1.0 for d in decisions)
    # Pair: baseline vs dim defines the band, seed by seed; dim sits on it, dark far below.
    band = parity_from_pair(runs["baseline"], runs["dim"], tolerance_db=0.5)
    assert band.per_fixture_db["gen-one"] == pytest.approx(dim.fixtures["gen-one"].psnr_db.mean, abs=0.01)
    assert band.per_seed_db["gen-one"] == {r.seed: r.psnr_db for r in dim.rows if r.fixture_id == "gen-one"}
    on_band = compare_run(runs["dim"], runs["baseline"], parity=band)
    below = compare_run(runs["dark"], runs["baseline"], parity=band)
    assert on_band.parity is not None and below.parity is not None
    assert on_band.parity.inside and not below.parity.inside and below.parity.decision == "outside"
    paired = on_band.fixtures["gen-one"].parity
    assert paired is not None and paired.method == "paired bootstrap" and paired.n == 2
    assert paired.difference_db == paired.low_db == paired.high_db == 0.0  # the pair's own images


def test_compare_command(runs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    base = str(runs["baseline"])
    assert _compare_cli(str(runs["same"]), "--baseline", base) == 0
    assert json.loads((runs["same"] / "compare.json").read_text())["overall"]["ok"] == 6
    assert _compare_cli(str(runs["dark"]), "--baseline", base, "--parity-pair", base, str(runs["dim"])) == 1
    out = capsys.readouterr().out
    assert "outside: " in out and "): OUTSIDE" in out and "lpips" in out
    (runs["baseline"] / "images" / "gen-one.s1.png").write_bytes(b"tampered")
    with pytest.raises(DitqError, match="does not match its seal"):
        _compare_cli(str(runs["same"]), "--baseline", base)
    assert _compare_cli(str(runs["dim"]), "--baseline", base, "--allow-unsealed", "--json", "--no-lpips") == 1
    result = json.loads(capsys.readouterr().out)[0]
    assert result["baseline_seal"].startswith("unsealed (allowed)")
    assert [r["status"] for r in result["rows"]].count(
        "error"
    ) == 1  # the tampered baseline image cannot be read


def test_images_made_with_other_settings_are_error_rows(runs: dict[str, Path]) -> None:
    records = runs["same"] / "records.jsonl"
    lines = [json.loads(line) for line in records.read_text().splitlines()]
    for record in lines:
        if record["fixture_id"] == "gen-one":
            record["steps"] = 20
    records.write_text("".join(json.dumps(r) + "\n" for r in lines))
    result = compare_run(runs["same"], runs["baseline"])
    bad = [r for r in result.rows if r.status == "error"]
    assert {r.fixture_id for r in bad} == {"gen-one"} and "steps 20 vs baseline 4" in (bad[0].error or "")


def test_the_lossless_standard_decides_each_fixture_on_its_psnr_and_ssim_intervals(
    runs: dict[str, Path],
) -> None:
    same = compare_run(runs["same"], runs["baseline"])
    dark = compare_run(runs["dark"], runs["baseline"])
    assert same.lossless is not None and dark.lossless is not None
    assert (same.lossless.psnr_db, same.lossless.ssim) == (40.0, 0.98)  # the documented thresholds
    # identical images: every interval sits at the cap (PSNR 100 dB, SSIM 1), inside
    assert same.lossless.decision == "inside" and same.lossless.inside
    for entry in same.fixtures.values():
        assert entry.lossless is not None and entry.lossless.decision == "inside" and entry.lossless.n == 2
        assert (
            entry.lossless.ssim.high is not None and entry.lossless.ssim.high <= 1.0
        )  # clipped to what SSIM can be
    # RGB halved: far below 40 dB on every fixture, whatever the spread
    assert dark.lossless.decision == "outside" and not dark.lossless.inside
    for entry in dark.fixtures.values():
        assert entry.lossless is not None and entry.lossless.psnr_db.decision == "outside"
        assert entry.lossless.psnr_db.high is not None and entry.lossless.psnr_db.high < 40.0


def test_a_stated_threshold_moves_the_lossless_decision(runs: dict[str, Path]) -> None:
    from ditq.judge.compare import LosslessStandard

    dim = compare_run(runs["dim"], runs["baseline"])
    entry = next(iter(dim.fixtures.values()))
    assert entry.lossless is not None and entry.psnr_db.mean is not None
    low = compare_run(runs["dim"], runs["baseline"], lossless=LosslessStandard(psnr_db=5.0, ssim=0.1))
    high = compare_run(runs["dim"], runs["baseline"], lossless=LosslessStandard(psnr_db=99.0, ssim=0.999))
    assert low.lossless is not None and low.lossless.psnr_db == 5.0
    assert all(
        e.lossless is not None and e.lossless.psnr_db.decision != "outside" for e in low.fixtures.values()
    )
    assert high.lossless is not None and high.lossless.decision == "outside"


def test_compare_exits_on_the_standard_it_is_asked_for(runs: dict[str, Path]) -> None:
    base = ("--baseline", str(runs["baseline"]), "--no-lpips")
    assert _compare_cli(str(runs["same"]), *base, "--standard", "lossless") == 0
    assert _compare_cli(str(runs["dark"]), *base, "--standard", "lossless") == 1
    # no band: the parity standard has nothing to fail on, so every image compared is enough
    assert _compare_cli(str(runs["dark"]), *base) == 0
    with pytest.raises(DitqError, match=r"--lossless-ssim 1\.5"):
        _compare_cli(str(runs["same"]), *base, "--lossless-ssim", "1.5")
    written = json.loads((runs["dark"] / "compare.json").read_text())
    assert written["lossless"]["decision"] == "outside"
