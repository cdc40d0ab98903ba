"""The seed's round-one records through `ditq report`: its int8 weight-only run (16 requests, structure
recorded, no images; tests/data/harness/seed-rtx3090) collapsed, and the verdict must say so.

The report reads the run directories as a sweep leaves them: the candidate's records beside the gate's
judgment of them (gate.json), and a baseline run of the same requests. The seed kept no BF16 records, so the
baseline here is the seed's own request lines with the structure numbers of a healthy image (the W8A8 round's:
opaque 0.947-0.988, alpha mean about 255, RGB spread 21-72).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ditq.cli import main
from ditq.judge.gate import build_envelopes, gate_run, load_rules
from ditq.report import validate_verdict_file
from ditq.runfiles import GATE_FILE, write_model

SEED_RUN = Path(__file__).parents[1] / "data" / "harness" / "seed-rtx3090"


def _healthy_baseline(root: Path) -> Path:
    """The seed's requests (fixtures, seeds, sizes, wall times, peaks) with healthy, seed-varying structure."""
    records = json.loads((SEED_RUN / "matrix.json").read_text())
    for index, record in enumerate(records):
        record["structure"] = {
            "opaque_fraction": 0.947 + 0.002 * index,
            "alpha_mean": 254.9 + 0.005 * index,
            "rgb_std": [21.0 + 3 * index, 30.0 + 2 * index, 40.0 + index],
        }
    baseline = root / "bf16"
    baseline.mkdir()
    (baseline / "matrix.json").write_text(json.dumps(records))
    return baseline


def _report(candidate: Path, baseline: Path, out: Path, capsys: pytest.CaptureFixture[str]) -> str:
    assert (
        main(["report", str(candidate), "--baseline", str(baseline), "--out", str(out), "--allow-unsealed"])
        == 0
    )
    return capsys.readouterr().out.splitlines()[0]


def test_the_seed_s_round_one_run_is_not_fit_to_serve_for_collapse(tmp_path, capsys):
    baseline = _healthy_baseline(tmp_path)
    candidate = tmp_path / "int8-weight-only"
    shutil.copytree(SEED_RUN, candidate)
    rules = load_rules()
    judged = gate_run(candidate, rules, build_envelopes(baseline, rules), "bf16", baseline)
    assert judged.format == "seed-matrix" and not any(r.passed for r in judged.records)
    write_model(candidate / GATE_FILE, judged.to_file())  # as `ditq gate` leaves it beside a ditq run

    printed = _report(candidate, baseline, tmp_path / "report", capsys)
    document = validate_verdict_file(tmp_path / "report" / "verdict.json")
    (verdict,) = document.candidates
    fit = verdict.objectives.fit_to_serve
    assert (verdict.name, verdict.verdict, fit.answer) == ("int8-weight-only", "NO", "NO")
    # its own collapse, not the baseline's; no images were kept, so no PSNR either
    assert [r.code for r in fit.reasons] == ["collapsed_outputs", "no_fidelity_result"]
    assert fit.reasons[0].message.startswith("Collapsed outputs: the structure gate failed 16 of 16 images (")
    assert {"flat", "transparent"} <= set(fit.reasons[0].message.split("(")[1].rstrip(").").split(", "))
    assert (
        printed.startswith("int8-weight-only: NO (fit_to_serve, lossless;") and "Collapsed outputs" in printed
    )
    assert verdict.profile.max_references_served == 4  # every request answered 200: it served, it collapsed


def test_without_the_gate_s_judgment_the_seed_s_run_is_never_a_yes(tmp_path, capsys):
    baseline = _healthy_baseline(tmp_path)
    candidate = tmp_path / "int8-weight-only"
    shutil.copytree(SEED_RUN, candidate)

    _report(candidate, baseline, tmp_path / "report", capsys)
    (verdict,) = validate_verdict_file(tmp_path / "report" / "verdict.json").candidates
    assert verdict.verdict == "UNDECIDED"
    assert [r.code for r in verdict.reasons] == ["no_gate_result", "no_fidelity_result"]
