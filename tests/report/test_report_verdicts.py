"""Verdict rules on synthetic runs: each reason fires for its cause and only for it."""

from __future__ import annotations

import json
from pathlib import Path

from ditq.report import VerdictRules, build_report, load_candidate
from ditq.report.assess import assess
from ditq.report.capacity import capacity_matrix, max_references_served

from .synthetic import ARTIFACT_DIGEST, RunSpec, write_run


def _assess(runs: dict[str, Path], *names: str, rules: VerdictRules | None = None):
    baseline = load_candidate(runs["baseline"])
    return assess(baseline, [load_candidate(runs[n]) for n in names], "ditq report", rules)


def test_healthy_faster_candidate_is_yes_with_its_profile(runs):
    (a,) = _assess(runs, "w8a8").assessments
    assert a.verdict == "YES", a.reasons
    assert a.profile.max_references_served == 4
    assert a.profile.seconds_per_image == {"1": 1.45, "2": 1.8, "3": 2.15, "4": 2.5}
    assert (
        a.profile.scheme is None
    )  # a bare probe run does not know its scheme; a sweep's CANDIDATE.json does
    assert a.profile.peak_memory_bytes == 900 * 2**20  # the vram.csv maximum


PARITY = VerdictRules(standard="parity")


def test_collapsed_candidate_names_the_gate_and_the_band(runs):
    (a,) = _assess(runs, "fp8", rules=PARITY).assessments
    codes = [r.code for r in a.reasons]
    assert codes == ["collapsed_outputs", "outside_parity_band"]
    assert "failed 8 of 8 images (banded, transparent)" in a.reasons[0].message
    message = a.reasons[1].message
    # at 2 seeds the interval is Student's t_1 (12.7) standard errors either side, never the pair's range
    assert message.startswith(
        "Outside the parity band on fx-one, fx-two, fx-three: -25.75 dB [-27.43, -24.08]"
    )
    assert message.endswith("vs the stated band over 2 seeds (floor -1 dB).")
    assert a.verdict == "NO" and a.objectives.fit_to_serve.answer == "NO"
    (first, *_) = a.objectives.fit_to_serve.intervals
    assert (first.subject, first.decision, first.n) == ("fx-one (PSNR minus the stated band's)", "outside", 2)
    assert first.high is not None and first.high < -1.0
    # under the lossless standard (the default) the same run is below it, on its PSNR and its SSIM
    (b,) = _assess(runs, "fp8").assessments
    assert [r.code for r in b.reasons] == ["collapsed_outputs", "below_lossless"]
    assert b.reasons[1].message.startswith("Not visually lossless on fx-one, fx-two, fx-three: PSNR 4.25 dB")
    lossless = b.objectives.fit_by_standard["lossless"]
    assert lossless is b.objectives.fit_to_serve or lossless == b.objectives.fit_to_serve
    psnr, ssim = lossless.intervals[:2]
    assert (psnr.measure, psnr.threshold, psnr.decision) == ("psnr_db", "at least 40 dB", "outside")
    assert (ssim.measure, ssim.threshold, ssim.decision) == ("ssim", "at least 0.98", "outside")
    assert psnr.high is not None and psnr.high < 40 and ssim.high is not None and ssim.high < 0.98
    assert a.objectives.fit_by_standard["lossless"].answer == "NO"  # both standards answered either way


def test_out_of_memory_is_unfit_and_slower_than_bf16_is_not_faster(runs):
    (a,) = _assess(runs, "w8a16").assessments
    assert [r.code for r in a.reasons] == ["out_of_memory"] and a.verdict == "NO"
    assert a.reasons[0].message == "Out of memory at 4 references (2 of 2 requests)."
    faster = a.objectives.faster
    assert faster.answer == "NO" and [r.code for r in faster.reasons] == ["slower_than_baseline"]
    # 1.5x the BF16 wall at 1-3 references; at 4 BF16 itself ran out of memory, so no comparison there
    assert "at 1, 2, 3 reference(s)" in faster.reasons[0].message
    assert [(e.subject, e.decision) for e in faster.intervals] == [
        ("1 reference", "slower"),
        ("2 references", "slower"),
        ("3 references", "slower"),
    ]
    assert all(e.low is not None and e.low > 1.05 for e in faster.intervals)
    assert a.profile.max_references_served == 3
    assert set(a.profile.seconds_per_image) == {"1", "2", "3"}


def test_each_objective_answers_apart_and_the_headline_follows_the_objective(runs):
    (a,) = _assess(runs, "w8a8").assessments
    objectives = a.objectives
    assert (objectives.fit_to_serve.answer, objectives.faster.answer) == ("YES", "YES")
    assert all(
        e.decision == "faster" and e.high is not None and e.high < 0.95 for e in objectives.faster.intervals
    )
    # a bare probe run does not know its weight bytes: nothing to say about size
    assert objectives.smaller.answer == "UNDECIDED"
    assert [r.code for r in objectives.smaller.reasons] == ["no_memory_comparison"]
    (w8a16,) = _assess(runs, "w8a16", rules=VerdictRules(objective="speed")).assessments
    assert (w8a16.objective, w8a16.verdict) == ("faster", "NO")
    assert _assess(runs, "w8a16", rules=VerdictRules(objective="memory")).document.objective == "smaller"


def test_a_fixture_on_the_edge_of_the_band_is_undecided_with_the_seeds_to_settle_it(tmp_path, runs):
    from ditq.judge.compare import ParityBand, compare_run
    from ditq.runfiles import write_model

    spec = RunSpec("close", "healthy", {1: 1, 2: 1, 3: 1, 4: 1}, parity_db=None)
    run = write_run(tmp_path, spec, runs["baseline"])
    level = compare_run(run, runs["baseline"], use_lpips=False).fixtures["fx-one"].psnr_db.mean
    assert level is not None
    # the band's floor (its PSNR minus 1 dB) just above the candidate's own mean PSNR on fx-one
    band = ParityBand("stated", level + 1.05, {}, 1.0)
    write_model(run / "compare.json", compare_run(run, runs["baseline"], parity=band, use_lpips=False))
    (a,) = assess(load_candidate(runs["baseline"]), [load_candidate(run)], "x", PARITY).assessments
    assert a.verdict == "UNDECIDED"
    assert [r.code for r in a.reasons] == ["undecided_parity_band"]
    (edge,) = [e for e in a.objectives.fit_to_serve.intervals if e.subject.startswith("fx-one")]
    assert edge.decision == "undecided" and edge.low is not None and edge.high is not None
    assert edge.low < -1.0 < edge.high
    # a bare run's settling command probes the baseline and the run at the seeds compare asks for, then judges
    command = a.objectives.fit_to_serve.settle_command
    assert edge.samples_to_settle is not None and edge.samples_to_settle > 2
    assert command is not None and "ditq baseline models/bf16 --endpoint http://127.0.0.1:9000" in command
    assert "ditq probe --endpoint http://127.0.0.1:9000" in command
    assert command.count(f"--seeds 2301-{2300 + edge.samples_to_settle} ") == 2 and "--parity-db" in command
    assert (
        a.objectives.fit_by_standard["lossless"].answer == "YES"
    )  # far above 40 dB: the other standard passes


def test_bf16_out_of_memory_is_a_result_in_the_baseline_matrix(runs):
    baseline = load_candidate(runs["baseline"])
    assert baseline.run is not None
    rows = {row.n_references: row for row in capacity_matrix(baseline.run)}
    assert rows[4].out_of_memory == 2 and rows[4].served == 0 and rows[4].wall_mean_s is None
    assert max_references_served(baseline) == 3


def test_slower_tolerance_is_data(runs):
    (a,) = _assess(runs, "w8a16", rules=VerdictRules(slower_tolerance=0.6)).assessments
    assert [e.decision for e in a.objectives.faster.intervals] != ["slower"] * 3


def test_missing_gate_and_band_are_reasons_not_silence(tmp_path, runs):
    spec = RunSpec("nogate", "healthy", {1: 1, 2: 1, 3: 1, 4: 1}, gate=False, parity_db=None)
    write_run(tmp_path, spec, runs["baseline"])
    (a,) = assess(
        load_candidate(runs["baseline"]), [load_candidate(tmp_path / "nogate")], "x", PARITY
    ).assessments
    assert [r.code for r in a.reasons] == ["no_gate_result", "no_fidelity_result"]
    # the lossless standard needs no band: only the gate is missing
    (c,) = assess(load_candidate(runs["baseline"]), [load_candidate(tmp_path / "nogate")], "x").assessments
    assert [r.code for r in c.reasons] == ["no_gate_result"] and c.verdict == "UNDECIDED"
    rules = VerdictRules(parity_reference_db=30.0, standard="parity")
    (b,) = assess(
        load_candidate(runs["baseline"]), [load_candidate(tmp_path / "nogate")], "x", rules
    ).assessments
    assert [r.code for r in b.reasons] == ["no_gate_result"]
    assert b.floor_db == 29.0


def test_failed_requests_are_their_own_reason(tmp_path, runs):
    spec = RunSpec("flaky", "healthy", {1: 1, 2: 1, 3: 1, 4: 1}, fail_refs=(2,))
    write_run(tmp_path, spec, runs["baseline"])
    (a,) = assess(load_candidate(runs["baseline"]), [load_candidate(tmp_path / "flaky")], "x").assessments
    assert [r.code for r in a.reasons] == ["failed_requests"]
    assert a.reasons[0].message == "2 of 8 requests failed (first: HTTP 500 generation_failed)."


def test_candidate_whose_server_never_started(tmp_path, runs):
    candidate = tmp_path / "sweep" / "fp8"
    candidate.mkdir(parents=True)
    stages = {
        "quantize": {"status": "ok", "command": "ditq quantize M A --scheme fp8", "seconds": 3.0},
        "serve": {"status": "failed", "message": "the server never answered /health within 60 s"},
    }
    (candidate / "CANDIDATE.json").write_text(json.dumps({"name": "fp8", "scheme": "fp8", "stages": stages}))
    result = build_report([candidate, runs["w8a8"]], runs["baseline"], tmp_path / "report")
    fp8 = result.data.document.candidates[0]
    assert fp8.verdict == "NO" and fp8.run is None
    assert [(r.code, r.message) for r in fp8.reasons] == [
        ("stage_failure", "The serve step failed: the server never answered /health within 60 s.")
    ]
    assert fp8.profile.max_references_served == 0
    assert result.verdicts == {"fp8": "NO", "w8a8": "YES"}
    assert "The serve step failed" in result.markdown.read_text()


def test_seed_matrix_records_are_read(tmp_path, runs):
    """The seed's evidence shape: a matrix.json list of records, no images, server-reported peaks."""
    seed_dir = tmp_path / "seed"
    seed_dir.mkdir()
    matrix = [
        {
            "fixture_id": "fx-one",
            "seed": seed,
            "n_references": 1,
            "steps": 20,
            "true_cfg_scale": 1.0,
            "size": "864x1152",
            "wall_s": 31.0 + i,
            "http": 200,
            "sha256": "ab" * 32,
            "error": None,
            "structure": {"opaque_fraction": 0.03},
            "metrics": {"peak_memory_mb": 21594.0},
        }
        for i, seed in enumerate((2301, 2302))
    ]
    (seed_dir / "matrix.json").write_text(json.dumps(matrix))
    candidate = load_candidate(seed_dir)
    assert candidate.run is not None and not candidate.run.has_images
    (row,) = capacity_matrix(candidate.run)
    assert (row.served, row.wall_mean_s, row.peak_memory_bytes) == (2, 31.5, 21594 * 2**20)


def test_doctor_finding_makes_an_otherwise_healthy_candidate_no(tmp_path, runs):
    candidate = tmp_path / "sweep" / "w8a8"
    candidate.mkdir(parents=True)
    spec = RunSpec("run", "healthy", {k: v * 0.7 for k, v in {1: 2.0, 2: 2.5, 3: 3.0, 4: 3.5}.items()})
    write_run(candidate, spec, runs["baseline"])
    doctor = {"passed": False, "failing": ["triton-w8a8"], "checked": 3, "report": "doctor-reports"}
    stages = {"doctor": {"status": "ok"}, "probe": {"status": "ok"}}
    (candidate / "CANDIDATE.json").write_text(
        json.dumps(
            {
                "name": "w8a8",
                "scheme": "w8a8",
                "doctor": doctor,
                "stages": stages,
                "max_memory": "24GiB",
                "artifact_digest": ARTIFACT_DIGEST,
            }
        )
    )
    (a,) = assess(load_candidate(runs["baseline"]), [load_candidate(candidate)], "x").assessments
    assert [(r.code, r.message) for r in a.reasons] == [
        (
            "doctor_failure",
            "The doctor found kernel path(s) triton-w8a8 wrong against float32 on this device.",
        )
    ]
    assert a.profile.memory_budget == "24GiB" and a.profile.max_references_served == 4


def test_signatures_the_baseline_shows_too_are_their_own_reason_not_a_collapse(runs, tmp_path):
    """gate.json marks a signature the baseline's own image shows as inherited (a model with random weights)."""
    import shutil

    candidate = tmp_path / "w8a8"
    shutil.copytree(runs["w8a8"], candidate)
    gate = json.loads((candidate / "gate.json").read_text())
    for row in gate["records"]:
        row["inherited"] = ["transparent: opaque_fraction 0.0015 < 0.5", "banded: banding_score 0.61 > 0.6"]
    (candidate / "gate.json").write_text(json.dumps(gate))
    (a,) = _assess({**runs, "inherited": candidate}, "inherited").assessments
    assert [r.code for r in a.reasons] == ["baseline_collapsed"]
    assert "(banded, transparent) for 8 of 8 of these images" in a.reasons[0].message


def test_an_incomplete_run_is_never_a_yes(tmp_path, runs):
    """A run judged while complete loses a record (its gate.json and compare.json still say it passed): the
    verdict is not YES, and its first reason names what is missing, however good the rest looks."""
    spec = RunSpec("partial", "healthy", {1: 1.45, 2: 1.8, 3: 2.15, 4: 2.5})
    run = write_run(tmp_path, spec, runs["baseline"])
    (before,) = assess(load_candidate(runs["baseline"]), [load_candidate(run)], "x").assessments
    assert before.verdict == "YES", before.reasons
    lines = (run / "records.jsonl").read_text().splitlines(keepends=True)
    (run / "records.jsonl").write_text("".join(lines[:-1]))
    lost = json.loads(lines[-1])

    result = build_report([run], runs["baseline"], tmp_path / "report")
    verdict = json.loads(result.verdict_json.read_text())["candidates"][0]
    assert verdict["verdict"] != "YES" and verdict["reasons"][0]["code"] == "incomplete_run"
    missing = f"1 of 8 planned requests have no record (first: {lost['fixture_id']} s{lost['seed']})"
    assert missing in verdict["reasons"][0]["message"]


def test_a_candidate_served_on_two_devices_is_compared_per_device(tmp_path: Path) -> None:
    """0.7x the baseline's seconds on two devices is 1.4x its device-seconds: slower per device, and said so."""
    walls = {k: 2.0 + 0.5 * k for k in range(1, 5)}
    baseline = write_run(tmp_path, RunSpec("bf16", "baseline", walls))
    cp2 = write_run(
        tmp_path, RunSpec("w8a8-cp2", "healthy", {k: v * 0.7 for k, v in walls.items()}, parallel="cp=2")
    )
    (a,) = assess(load_candidate(baseline), [load_candidate(cp2)], "ditq report").assessments
    faster = a.objectives.faster
    assert faster.answer == "NO" and {e.measure for e in faster.intervals} == {"device_time_ratio"}
    assert all(e.estimate is not None and 1.35 < e.estimate < 1.45 for e in faster.intervals)
    assert "device-seconds per image (seconds x 2 device(s) for it, x 1 for bf16" in faster.reasons[0].message
    assert [row.parallel for row in a.matrix] == [("cp=2",)] * 4
    assert {p.parallel for p in a.profile.by_references} == {"cp=2"}
