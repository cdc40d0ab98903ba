"""`ditq plan` -> `ditq quantize --plan` -> `ditq verify` -> `ditq sweep --plan`, end to end on the tiny demo pipeline;
and the plan command's one-line refusals."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from ditq.cli import main
from ditq.plan import KEEP, PLAN_FILE, plan_sha256, read_plan, write_plan
from ditq.report import validate_verdict_file
from ditq.runfiles import CandidateFile, SweepFile, read_model
from ditq.runtime.options import LoadOptions
from ditq.sweep import PLAN_CANDIDATE, SweepOptions, run_sweep

# fp8 everywhere reaches about 64 dB against float32 on this model; 70 dB asks for a mix
TARGET_DB = "70"


@pytest.fixture(scope="module")
def planned(tiny_workspace: Path) -> Path:
    out = tiny_workspace / "PLAN.json"
    code = main(
        [
            "plan", str(tiny_workspace / "model"), "--fixtures", str(tiny_workspace / "fixtures.json"),
            "--refs", str(tiny_workspace / "refs"), "--out", str(out), "--schemes", "fp8,w8a8",
            "--target-db", TARGET_DB, "--seeds", "1-2", "--steps", "2", "--max-rounds", "2",
            "--image-blocks", "1",  # of the two blocks, the second's images (the middle of one run of two)
        ]
    )  # fmt: skip
    assert code in (0, 1) and out.is_file()  # 1: written, but its verification missed the target
    return out


@pytest.mark.slow
def test_the_plan_is_measured_searched_and_verified(planned: Path):
    plan = read_plan(planned)
    assert plan.target.kind == "db" and plan.target.per_fixture_db == {"edit-one": 70.0, "draw": 70.0}
    linears = [e for e in plan.sensitivity if e.unit == "layer"]
    assert sorted(e.layer for e in linears) == sorted(plan.layers) and len(linears) == 14
    assert all(set(e.proxy) == {"fp8", "w8a8"} and not e.psnr_db for e in linears)
    blocks = [e for e in plan.sensitivity if e.unit != "layer"]
    assert [e.layer for e in blocks] == ["transformer_blocks.0", "transformer_blocks.1", "(all)"]
    assert all(set(e.proxy) == {"fp8", "w8a8"} for e in blocks)
    # --image-blocks 1: one block's images and the whole component's calibrate the proxy, the other block has none
    assert [sorted(e.psnr_db) for e in blocks] == [[], ["fp8", "w8a8"], ["fp8", "w8a8"]]
    # a mix: not every layer at fp8, and every layer not at fp8 says why
    assert set(plan.layers.values()) - {"fp8"}
    assert set(plan.reasons) == {layer for layer, choice in plan.layers.items() if choice != "fp8"}
    params = {e.layer: e.params for e in linears}
    quantized = sum(params[layer] for layer, choice in plan.layers.items() if choice != KEEP)
    assert plan.quantized_fraction == pytest.approx(quantized / sum(params.values()), abs=1e-4)
    verification = plan.verification
    assert verification is not None and verification.artifact and verification.seeds == [1, 2]
    assert set(verification.psnr_db) == {"edit-one", "draw"}
    assert verification.meets_target == all(db >= 70.0 for db in verification.psnr_db.values())
    assert plan.calibration is not None and plan.calibration.points > 0
    assert plan.cost is not None and plan.cost.forwards > 0 and plan.cost.device == "cpu"
    assert plan.command[0] == "ditq"  # the command line that ran (this process's: pytest's own arguments)


@pytest.mark.slow
def test_quantize_verify_and_sweep_take_the_plan(planned: Path, tiny_workspace: Path, tmp_path: Path):
    plan = read_plan(planned)
    artifact = tmp_path / "artifact"
    model = tiny_workspace / "model"
    assert main(["quantize", str(model), str(artifact), "--plan", str(planned)]) == 0
    assert main(["verify", str(artifact), "--source", str(model)]) == 0
    manifest = json.loads((artifact / "MANIFEST.json").read_text())
    assert manifest["components"]["transformer"]["quantized"] == sorted(
        layer for layer, choice in plan.layers.items() if choice != KEEP
    )

    options = SweepOptions(
        model=model,
        schemes=("w8a8",),
        fixtures=tiny_workspace / "fixtures.json",
        refs=tiny_workspace / "refs",
        out=tmp_path / "sweep",
        seeds="1-2",
        steps=2,
        load=LoadOptions(device="cpu", dtype="float32"),
        parity_db=30.0,
        health_timeout_s=300,
        progress=False,
        plan=planned,
    )
    run_sweep(options, command="ditq sweep --plan (test)")
    out = tmp_path / "sweep"
    assert read_model(SweepFile, out / "SWEEP.json").plan == str(planned)
    candidate = read_model(CandidateFile, out / PLAN_CANDIDATE / "CANDIDATE.json")
    assert {name: stage.status for name, stage in candidate.stages.items()} == dict.fromkeys(
        ("quantize", "verify", "doctor", "serve", "probe", "gate", "compare"), "ok"
    )
    assert "--plan" in (candidate.stages["quantize"].command or "")
    assert read_plan(out / PLAN_CANDIDATE / PLAN_FILE) == plan
    document = validate_verdict_file(out / "report" / "verdict.json")
    assert [c.name for c in document.candidates] == ["w8a8", PLAN_CANDIDATE]
    report = (out / "report" / "REPORT.md").read_text()
    assert "### Plan" in report and "per-layer sensitivity" in report
    assert (out / "report" / "charts" / f"plan-{PLAN_CANDIDATE}.png").is_file()

    # the same sweep with another plan: the planned candidate is quantized (and judged) again from it
    layer = next(name for name, choice in sorted(plan.layers.items()) if choice != KEEP)
    other = plan.model_copy(update={"layers": {**plan.layers, layer: KEEP}})
    write_plan(tmp_path / "OTHER.json", other)
    run_sweep(replace(options, plan=tmp_path / "OTHER.json"), command="ditq sweep --plan (test, again)")
    manifest = json.loads((out / PLAN_CANDIDATE / "artifact" / "MANIFEST.json").read_text())
    assert manifest["plan"]["sha256"] == plan_sha256(other)
    again = read_model(CandidateFile, out / PLAN_CANDIDATE / "CANDIDATE.json")
    assert all(stage.status == "ok" for stage in again.stages.values())


def test_a_budget_that_cannot_be_read_is_one_line(tiny_workspace: Path, capsys: pytest.CaptureFixture[str]):
    code = main(
        ["plan", str(tiny_workspace / "model"), "--fixtures", str(tiny_workspace / "fixtures.json"),
         "--refs", str(tiny_workspace / "refs"), "--out", str(tiny_workspace / "never.json"), "--budget", "lots",
         "--target-db", "40", "--steps", "1", "--seeds", "1", "--max-rounds", "1"]
    )  # fmt: skip
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and error.startswith("ditq plan: error: --budget: cannot read 'lots'")
    assert not (tiny_workspace / "never.json").exists()


def test_another_model_needs_its_fixtures(tiny_workspace: Path, capsys: pytest.CaptureFixture[str]):
    code = main(["plan", str(tiny_workspace / "model"), "--out", str(tiny_workspace / "never.json")])
    assert code == 2
    assert capsys.readouterr().err.strip() == (
        "ditq plan: error: --fixtures and --refs are needed for a model other than the bundled demo model"
    )


def test_an_unknown_scheme_says_what_it_may_have_meant(
    tiny_workspace: Path, capsys: pytest.CaptureFixture[str]
):
    code = main(["plan", str(tiny_workspace / "model"), "--out", "x.json", "--schemes", "fp8,w8a9"])
    assert code == 2 and "unknown scheme 'w8a9'" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--max-layers", "--image-blocks"])
def test_counts_below_zero_are_refused_by_the_planner(
    flag: str, tiny_workspace: Path, capsys: pytest.CaptureFixture[str]
):
    code = main(
        ["plan", str(tiny_workspace / "model"), "--fixtures", str(tiny_workspace / "fixtures.json"),
         "--refs", str(tiny_workspace / "refs"), "--out", str(tiny_workspace / "never.json"),
         flag, "-1", "--target-db", "40"]
    )  # fmt: skip
    assert code == 2 and capsys.readouterr().err.strip().splitlines()[-1] == (
        f"ditq plan: error: {flag}: at least 0, got -1"
    )
    assert not (tiny_workspace / "never.json").exists()


def test_max_seeds_below_the_seeds_given_is_refused(tiny_workspace: Path, capsys: pytest.CaptureFixture[str]):
    code = main(
        ["plan", str(tiny_workspace / "model"), "--fixtures", str(tiny_workspace / "fixtures.json"),
         "--refs", str(tiny_workspace / "refs"), "--out", str(tiny_workspace / "never.json"),
         "--seeds", "1-3", "--max-seeds", "2"]
    )  # fmt: skip
    assert code == 2 and capsys.readouterr().err.strip().splitlines()[-1] == (
        "ditq plan: error: --max-seeds: at least the 3 --seeds, got 2"
    )
    assert not (tiny_workspace / "never.json").exists()


def test_image_blocks_are_spread_evenly_through_the_component():
    from ditq.plan.planner import _with_images
    from ditq.plan.sensitivity import Unit

    units = [Unit(f"blocks.{i}", "block", (f"blocks.{i}.a",), 1) for i in range(60)]
    units.append(Unit("(all)", "component", tuple(f"blocks.{i}.a" for i in range(60)), 60))
    chosen = [u.name for u in units if _with_images(units, 4)(u)]
    assert chosen == ["blocks.7", "blocks.22", "blocks.37", "blocks.52", "(all)"]
    assert [u.name for u in units if _with_images(units, 0)(u)] == ["(all)"]
    assert all(_with_images(units, None)(u) for u in units) and all(_with_images(units, 99)(u) for u in units)


def test_the_verification_settles_an_undecided_fixture_with_more_seeds(tiny_workspace: Path, tmp_path: Path):
    """Under a parity target, a fixture the verification leaves undecided (mean at or above its floor) gets the
    seeds compare says would settle it, up to --max-seeds: the source precision, the bfloat16 pair and the
    candidate all run them, and the floors are measured again over them. A floor 9.5 dB above the pair (a
    tolerance of -9.5 dB) puts it next to what fp8 reaches on this model, so two seeds cannot decide."""
    from ditq.judge.compare import compare_run, parity_from_pair
    from ditq.plan.planner import PlanOptions, make_plan
    from ditq.probe.records import is_success, latest_by_key, read_records

    work = tmp_path / "work"
    options = PlanOptions(
        model=tiny_workspace / "model", out=tmp_path / "PLAN.json", fixtures=tiny_workspace / "fixtures.json",
        refs=tiny_workspace / "refs", schemes=("fp8", "w8a8"), seeds="1-2", steps=2, max_rounds=1,
        image_blocks=1, max_seeds=5, tolerance_db=-9.5, work=work,
    )  # fmt: skip
    plan = make_plan(options)
    verification = plan.verification
    assert verification is not None and verification.seeds == [1, 2] and verification.rounds == 1
    assert verification.seeds_added, (
        "two seeds left no fixture undecided: the floor no longer sits at fp8's PSNR"
    )
    seeds = {f: [1, 2, *verification.seeds_added.get(f, [])] for f in ("edit-one", "draw")}
    assert all(len(s) <= 5 and s == list(range(1, len(s) + 1)) for s in seeds.values())
    # every run holds every fixture at its seeds, so that each PSNR is paired
    for run in ("reference", "pair-bfloat16", "verify-1"):
        done = {key for key, record in latest_by_key(read_records(work / run)).items() if is_success(record)}
        assert {(f, s) for f, fs in seeds.items() for s in fs} <= done, run
    # the plan's floors and decisions are compare's over those seeds; each fixture ends decided, at the cap, or
    # with its mean below its floor
    band = parity_from_pair(work / "reference", work / "pair-bfloat16", -9.5)
    assert plan.target.per_fixture_db == {f: round(band.edge(f), 3) for f in seeds}
    result = compare_run(work / "verify-1", work / "reference", parity=band, use_lpips=False)
    for fixture_id, entry in result.fixtures.items():
        parity = entry.parity
        assert parity is not None and parity.n == len(seeds[fixture_id])
        assert parity.decision == verification.decisions[fixture_id]
        assert entry.psnr_db.mean == pytest.approx(verification.psnr_db[fixture_id], abs=1e-3)
        below = parity.difference_db is not None and parity.difference_db < parity.floor_db
        assert parity.decision != "undecided" or len(seeds[fixture_id]) == 5 or below
