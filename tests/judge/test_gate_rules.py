"""The gate: the seed's collapsed run fails 16/16, healthy soft-edged alpha passes, the envelope catches drift."""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from harness_kit import SEED_EVIDENCE_COPY, probe_run, served_record
from PIL import Image
from stub_images_server import StubServer, StubState, collapsed_image, healthy_image

from ditq.commands import gate as gate_command
from ditq.errors import InputError
from ditq.judge.baseline import seal_run
from ditq.judge.gate import build_envelopes, gate_run, load_rules
from ditq.metrics import structure_metrics
from ditq.probe.records import RecordLog
from ditq.runfiles import Structure


def _gate_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    gate_command.add_arguments(parser)
    return gate_command.run(parser.parse_args(list(argv)))


def _judge(structure: dict, tmp_path: Path) -> list[str]:
    """Gate one recorded structure (no image), as the seed's evidence is gated."""
    run = tmp_path / "one"
    run.mkdir(exist_ok=True)
    record = {  # the seed probe's record of a served request
        "fixture_id": "f",
        "seed": 1,
        "n_references": 1,
        "steps": 20,
        "true_cfg_scale": 1.0,
        "size": "64x64",
        "wall_s": 30.0,
        "http": 200,
        "sha256": "0" * 64,
        "structure": structure,
    }
    (run / "matrix.json").write_text(json.dumps([record]))
    return gate_run(run, load_rules()).records[0].reasons


def test_seed_int8_weight_only_run_fails_all_sixteen(capsys: pytest.CaptureFixture[str]) -> None:
    evidence = SEED_EVIDENCE_COPY
    result = gate_run(evidence, load_rules())
    assert result.format == "seed-matrix" and len(result.records) == 16
    assert not any(r.passed for r in result.records)
    assert all(r.structure_source == "recorded" for r in result.records)
    assert all(any(reason.startswith("transparent:") for reason in r.reasons) for r in result.records)
    summary = result.summary()
    assert sorted(summary) == [1, 2, 3, 4]
    assert all(row.n == 4 and row.passes == 0 for row in summary.values())
    assert summary[4].wall_min_s == 46.4 and summary[4].wall_max_s == 46.48
    assert _gate_cli(str(evidence)) == 1
    out = capsys.readouterr().out
    assert "GATE: FAIL (0/16 pass)" in out and "4-ref: n=4 pass=0/4 FAIL" in out


def test_healthy_soft_edged_alpha_passes(tmp_path: Path) -> None:
    # The W8A8 round's numbers: opaque 0.947-0.988, alpha mean 254.9-255.0, rgb std 21-72.
    for opaque in (0.947, 0.966, 0.988):
        assert (
            _judge({"opaque_fraction": opaque, "alpha_mean": 254.9, "rgb_std": [21.0, 45.0, 72.0]}, tmp_path)
            == []
        )
    # The same from pixels: an opaque picture whose outer ring of pixels is soft alpha (~0.95 opaque).
    image = np.asarray(healthy_image(3, 64, 64)).copy()
    image[:, :1, 3] = 200
    image[:, -1:, 3] = 230
    s = structure_metrics(image)
    assert 0.95 <= s["opaque_fraction"] < 0.99 and s["alpha_mean"] > 250
    assert _judge(s, tmp_path) == []


def test_cut_out_passes_but_fully_transparent_fails(tmp_path: Path) -> None:
    cut_out = np.asarray(healthy_image(4, 64, 64)).copy()
    cut_out[:, :40, 3] = 0  # 62% clear background, clean edge
    assert _judge(structure_metrics(cut_out), tmp_path) == []
    clear = cut_out.copy()
    clear[..., 3] = 0
    assert any(r.startswith("transparent") for r in _judge(structure_metrics(clear), tmp_path))


def test_collapse_signatures_from_pixels(tmp_path: Path) -> None:
    broken = _judge(structure_metrics(np.asarray(collapsed_image(1, 64, 48))), tmp_path)
    assert any(r.startswith("transparent") for r in broken) and any(r.startswith("banded") for r in broken)
    stripes = np.asarray(healthy_image(2, 64, 48)).copy()
    stripes[..., :3] = np.random.default_rng(0).integers(0, 256, size=(48, 1, 3))  # opaque row noise
    assert [r.split(":")[0] for r in _judge(structure_metrics(stripes), tmp_path)] == ["banded"]
    grey = np.full((32, 32, 4), 128, dtype=np.uint8)
    grey[..., 3] = 255
    assert [r.split(":")[0] for r in _judge(structure_metrics(grey), tmp_path)] == ["flat"]
    nan = np.full((8, 8, 3), np.nan)
    assert "non-finite" in [r.split(":")[0] for r in _judge(structure_metrics(nan), tmp_path)]


def test_envelope_ignores_an_invisible_alpha_step_and_catches_alpha_drift(
    tmp_path: Path, fixture_set
) -> None:
    """Alpha 254 everywhere (opaque_fraction 1 -> 0, invisible) is not drift; alpha 150 is."""
    runs = {"baseline": None, "alpha254": 254, "alpha150": 150}
    for name, alpha in runs.items():
        with StubServer(StubState(alpha=alpha)) as server:
            probe_run(server.url, fixture_set, tmp_path / name, [1, 2, 3] if alpha is None else [1, 2])
    seal_run(tmp_path / "baseline")
    rules = load_rules()
    envelopes = build_envelopes(tmp_path / "baseline", rules)
    assert gate_run(tmp_path / "alpha254", rules, envelopes).passed
    drifted = gate_run(tmp_path / "alpha150", rules, envelopes)
    assert not any(r.passed for r in drifted.records)
    assert all(any(x.startswith("drift: alpha_mean") for x in r.reasons) for r in drifted.records)


def test_envelope_passes_variation_and_fails_drift(tmp_path: Path, fixture_set) -> None:
    with StubServer() as server:
        probe_run(server.url, fixture_set, tmp_path / "baseline", [1, 2, 3])
        probe_run(server.url, fixture_set, tmp_path / "same", [4, 5])  # other seeds: ordinary variation
    with StubServer(StubState(dim=0.2)) as server:
        probe_run(server.url, fixture_set, tmp_path / "dim", [1, 2])
    seal_run(tmp_path / "baseline")
    rules = load_rules()
    envelopes = build_envelopes(tmp_path / "baseline", rules)
    assert set(envelopes) == {"gen-one", "edit-one", "edit-two"} and envelopes["gen-one"].n == 3
    assert gate_run(tmp_path / "same", rules, envelopes).passed
    assert gate_run(tmp_path / "dim", rules).passed  # no absolute signature: a dim image is not a collapse
    dim = gate_run(tmp_path / "dim", rules, envelopes)
    assert not any(r.passed for r in dim.records)
    assert all(any(x.startswith("drift: rgb_std_mean") for x in r.reasons) for r in dim.records)
    assert _gate_cli(str(tmp_path / "same"), "--baseline", str(tmp_path / "baseline")) == 0
    assert json.loads((tmp_path / "same" / "gate.json").read_text())["verdict"] == "PASS"
    assert _gate_cli(str(tmp_path / "dim"), "--baseline", str(tmp_path / "baseline"), "--json") == 1


def test_failed_requests_fail_the_gate(tmp_path: Path, fixture_set) -> None:
    with StubServer(StubState(fail_seeds={2})) as server:
        probe_run(server.url, fixture_set, tmp_path / "run", [1, 2])
    result = gate_run(tmp_path / "run", load_rules())
    failed = [r for r in result.records if not r.passed]
    assert {r.seed for r in failed} == {2} and all(
        r.reasons[0].startswith("request failed: HTTP 500") for r in failed
    )
    assert all(r.structure_source == "image" for r in result.records if r.seed == 1)


def test_images_win_over_recorded_structure(tmp_path: Path) -> None:
    run = tmp_path / "seedlike"
    shutil.copytree(SEED_EVIDENCE_COPY, run)
    (run / "matrix").mkdir()
    image = run / "matrix" / "edit-compose-four.s2301.png"
    Image.fromarray(np.asarray(healthy_image(1, 32, 32))).save(image)
    # the record names the image it was served as: this one, for the image to be believed over the structure
    matrix = json.loads((run / "matrix.json").read_text())
    for record in matrix:
        if (record["fixture_id"], record["seed"]) == ("edit-compose-four", 2301):
            record["sha256"] = hashlib.sha256(image.read_bytes()).hexdigest()
    (run / "matrix.json").write_text(json.dumps(matrix))
    result = gate_run(run, load_rules())
    healed = [r for r in result.records if r.fixture_id == "edit-compose-four" and r.seed == 2301]
    assert healed[0].structure_source == "image" and healed[0].passed
    assert sum(r.passed for r in result.records) == 1


def test_an_image_other_than_the_recorded_one_fails(tmp_path: Path) -> None:
    """Issue 28's rerun: a candidate image swapped for another (the baseline's, say) was judged as if served."""
    run = tmp_path / "seedlike"
    shutil.copytree(SEED_EVIDENCE_COPY, run)
    (run / "matrix").mkdir()
    Image.fromarray(np.asarray(healthy_image(1, 32, 32))).save(run / "matrix" / "edit-compose-four.s2301.png")
    result = gate_run(run, load_rules())
    swapped = [r for r in result.records if r.fixture_id == "edit-compose-four" and r.seed == 2301]
    assert swapped[0].structure_source == "image not the recorded one" and not swapped[0].passed
    assert swapped[0].reasons == ["image is not the one its record names (sha256 differs)"]


def test_rules_file_is_validated(tmp_path: Path) -> None:
    bad = tmp_path / "rules.json"
    bad.write_text(
        json.dumps({"signatures": [{"name": "x", "when": [{"metric": "alpha_mean", "below": 3}]}]})
    )
    with pytest.raises(InputError, match=r"signature 'x' 'when'.*OP one of"):
        load_rules(bad)
    bad.write_text(json.dumps({"signatures": [{"when": []}]}))
    with pytest.raises(InputError, match="malformed rules"):
        load_rules(bad)
    strict = tmp_path / "strict.json"
    strict.write_text(
        json.dumps(
            {"signatures": [{"name": "not-opaque", "when": [{"metric": "opaque_fraction", "lt": 0.99}]}]}
        )
    )
    assert _judge({"opaque_fraction": 0.95, "alpha_mean": 254.9, "rgb_std": [30, 30, 30]}, tmp_path) == []
    assert not gate_run(tmp_path / "one", load_rules(strict)).passed  # a stricter rule set is honoured


def test_gate_refuses_an_altered_baseline_unless_allowed(tmp_path: Path, fixture_set, capsys) -> None:
    from ditq.errors import DitqError

    with StubServer() as server:
        probe_run(server.url, fixture_set, tmp_path / "baseline", [1])
        probe_run(server.url, fixture_set, tmp_path / "run", [1])
    with pytest.raises(DitqError, match=r"SEAL\.json is missing"):
        _gate_cli(str(tmp_path / "run"), "--baseline", str(tmp_path / "baseline"))
    seal_run(tmp_path / "baseline")
    image = tmp_path / "baseline" / "images" / "gen-one.s1.png"
    image.write_bytes(image.read_bytes() + b"\0")
    with pytest.raises(DitqError, match=r"images/gen-one.s1.png does not match its seal.*--allow-unsealed"):
        _gate_cli(str(tmp_path / "run"), "--baseline", str(tmp_path / "baseline"))
    assert _gate_cli(str(tmp_path / "run"), "--baseline", str(tmp_path / "baseline"), "--allow-unsealed") == 0
    assert "unsealed (allowed)" in capsys.readouterr().out


def test_a_fixture_changed_since_the_baseline_is_caught(tmp_path: Path, fixture_set) -> None:
    from ditq.judge.compare import compare_run

    fixtures = fixture_set[0]
    with StubServer() as server:
        probe_run(server.url, fixture_set, tmp_path / "baseline", [1])
        changed = json.loads(fixtures.read_text())
        changed["edit-one"]["prompt"] = "make it dawn"
        fixtures.write_text(json.dumps(changed))
        probe_run(server.url, fixture_set, tmp_path / "run", [1])
        with pytest.raises(InputError, match=r"fixture 'edit-one' changed .* new --out"):
            probe_run(server.url, fixture_set, tmp_path / "baseline", [1, 2])  # resuming with it is refused
    seal_run(tmp_path / "baseline")
    rules = load_rules()
    result = gate_run(
        tmp_path / "run", rules, build_envelopes(tmp_path / "baseline", rules), "b", tmp_path / "baseline"
    )
    assert [r.fixture_id for r in result.records if not r.passed] == ["edit-one"]
    rows = compare_run(tmp_path / "run", tmp_path / "baseline").rows
    assert [r.fixture_id for r in rows if r.status == "error"] == ["edit-one"]


def _recorded_run(run: Path, structures: dict[tuple[str, int], dict]) -> Path:
    """A ditq-style run holding only records with their recorded structure (no images)."""
    run.mkdir(parents=True)
    with RecordLog(run / "records.jsonl") as log:
        for (fixture_id, seed), structure in structures.items():
            log.append(served_record(fixture_id, seed, Structure.model_validate(structure)))
    return run


def test_a_signature_the_baseline_shows_too_is_inherited_not_a_failure(tmp_path: Path) -> None:
    noise = {"opaque_fraction": 0.0015, "alpha_mean": 141.9, "rgb_std": [39.5, 43.4, 36.0]}  # random weights
    intact = {"opaque_fraction": 1.0, "alpha_mean": 255.0, "rgb_std": [40.0, 41.0, 42.0]}
    baseline = _recorded_run(tmp_path / "baseline", {("f", 1): noise, ("f", 2): intact})
    run = _recorded_run(tmp_path / "run", {("f", 1): noise, ("f", 2): noise})
    by_seed = {r.seed: r for r in gate_run(run, load_rules(), baseline_dir=baseline).records}
    # seed 1: the baseline's own image is transparent too, so the candidate's is not a collapse of its own
    assert by_seed[1].passed and by_seed[1].inherited[0].startswith("transparent:")
    # seed 2: the baseline's image is intact, so the same transparent image is a failure
    assert not by_seed[2].passed and by_seed[2].reasons[0].startswith("transparent:")
    assert by_seed[2].inherited == []
    # without a baseline both fail, as before
    assert not any(r.passed for r in gate_run(run, load_rules()).records)
