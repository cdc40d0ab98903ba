"""Provenance of seeds a sweep added (--seeds auto): the report says, per fixture, how many were added and on
how many the fixture was decided, and lists the commands that added them behind the candidate's numbers."""

from __future__ import annotations

import json

from ditq.report import build_report, validate_verdict_file
from ditq.runfiles import CandidateFile, StageEntry, write_model

from .synthetic import ARTIFACT_DIGEST, SEEDS, RunSpec, write_run

# As the sweep records them: the server of the first offload rung, then the probe of the added seeds only.
SEED_COMMANDS = [
    "ditq serve sweep/w8a8/artifact --port 41001 --offload none",
    "ditq probe --endpoint http://127.0.0.1:41001 --out sweep/w8a8/run --seeds 2301-2302 --only fx-one",
]


def test_the_seeds_a_sweep_added_and_their_commands_are_in_the_provenance(tmp_path, runs):
    candidate = tmp_path / "sweep" / "w8a8"
    candidate.mkdir(parents=True)
    write_run(candidate, RunSpec("run", "healthy", {1: 1.4, 2: 1.8, 3: 2.1, 4: 2.5}), runs["baseline"])
    probe = "ditq probe --endpoint http://127.0.0.1:41000 --out sweep/w8a8/run --seeds 2301"
    write_model(
        candidate / "CANDIDATE.json",
        CandidateFile(
            name="w8a8",
            scheme="w8a8",
            artifact_digest=ARTIFACT_DIGEST,
            stages={"probe": StageEntry(status="ok", command=probe)},
            seeds_added={"fx-one": 1},
            seed_commands=SEED_COMMANDS,
        ),
    )
    result = build_report([candidate], runs["baseline"], tmp_path / "report")

    document = validate_verdict_file(result.verdict_json)
    assert document.provenance.run_commands["w8a8"] == [probe, *SEED_COMMANDS]
    fx_one = [e for e in document.candidates[0].objectives.fit_to_serve.intervals if "fx-one" in e.subject]
    assert [e.measure for e in fx_one] == ["psnr_db", "ssim"]  # the lossless standard's two intervals
    assert all((e.n, e.samples_added) == (len(SEEDS), 1) for e in fx_one)
    markdown = result.markdown.read_text()
    assert f"| w8a8 seeds added | fx-one +1 ({len(SEEDS)} in all) |" in markdown
    for command in SEED_COMMANDS:
        assert f"| w8a8 command | {command} |" in markdown
    assert "seeds added" in result.html.read_text()


def test_a_candidate_file_from_before_seed_commands_still_reads(tmp_path, runs):
    candidate = tmp_path / "sweep" / "w8a8"
    candidate.mkdir(parents=True)
    write_run(candidate, RunSpec("run", "healthy", {1: 1.4, 2: 1.8, 3: 2.1, 4: 2.5}), runs["baseline"])
    (candidate / "CANDIDATE.json").write_text(
        json.dumps({"name": "w8a8", "seeds_added": {}, "artifact_digest": ARTIFACT_DIGEST})
    )
    result = build_report([candidate], runs["baseline"], tmp_path / "report")
    assert "seeds added" not in result.markdown.read_text()
    assert result.verdicts == {"w8a8": "YES"}
