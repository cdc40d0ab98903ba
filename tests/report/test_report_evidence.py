"""Evidence chained, not believed (issue 48): the report derives each candidate's verdict from records and images
whose digests chain back to its artifact and the sealed baseline, and refuses, in one line naming the file, a
run that is not its candidate's, a run pointer out of the candidate's folder, repeated seeds, a fixture digest
its own fixtures do not give, a record whose wall_s its window does not hold, and a compare.json its images do
not show. Each forgery below changed the verdict (exit 0) before."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ditq.cli import main
from ditq.report import build_report

from .synthetic import ARTIFACT_DIGEST

OTHER_DIGEST = "cd" * 32


def _json(path: Path, change: Callable[[Any], Any]) -> None:
    data = json.loads(path.read_text())
    path.write_text(json.dumps(change(data) or data))


def _lines(path: Path, change: Callable[[list[dict[str, Any]]], None]) -> None:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    change(lines)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def _served(run: Path, digest: str) -> None:
    """The run's server starts said they served the artifact ``digest``."""

    def change(doc: dict[str, Any]) -> None:
        for invocation in doc["invocations"]:
            for server in invocation["servers"]:
                server["health"]["artifact_digest"] = digest

    _json(run / "RUN.json", change)


def _candidate(root: Path, name: str, run: Path, digest: str = ARTIFACT_DIGEST) -> Path:
    """A sweep's candidate folder: CANDIDATE.json naming ``digest``, and a copy of ``run`` as its run/."""
    folder = root / name
    shutil.copytree(run, folder / "run")
    stages = {"probe": {"status": "ok"}, "gate": {"status": "ok"}, "compare": {"status": "ok"}}
    document = {"name": name, "scheme": name, "artifact_digest": digest, "stages": stages}
    (folder / "CANDIDATE.json").write_text(json.dumps(document))
    return folder


@pytest.fixture
def sweep(runs: dict[str, Path], tmp_path: Path) -> dict[str, Path]:
    """Two chained candidates (w8a8 healthy, fp8 collapsed, each its own artifact) over the synthetic baseline."""
    root = tmp_path / "sweep"
    w8a8 = _candidate(root, "w8a8", runs["w8a8"])
    fp8 = _candidate(root, "fp8", runs["fp8"], OTHER_DIGEST)
    _served(fp8 / "run", OTHER_DIGEST)
    return {"baseline": runs["baseline"], "w8a8": w8a8, "fp8": fp8}


def _compare_inside_psnr_99(sweep: dict[str, Path]) -> str:
    def change(doc: dict[str, Any]) -> None:
        for row in doc["rows"]:
            row.update(status="ok", psnr_db=99.0, ssim=1.0, error=None)
        doc["lossless"].update(inside=True, decision="inside")

    _json(sweep["fp8"] / "run" / "compare.json", change)
    return "compare.json: says"


def _run_of_another_artifact(sweep: dict[str, Path]) -> str:
    shutil.rmtree(sweep["fp8"] / "run")
    shutil.copytree(sweep["w8a8"] / "run", sweep["fp8"] / "run")  # its RUN.json names w8a8's artifact
    return "not this candidate's"


def _run_pointer_to_a_sibling(sweep: dict[str, Path]) -> str:
    _json(sweep["fp8"] / "CANDIDATE.json", lambda doc: {**doc, "run": "../w8a8/run"})
    return "CANDIDATE.json: run: String should match pattern"


def _run_pointer_to_etc(sweep: dict[str, Path]) -> str:
    _json(sweep["fp8"] / "CANDIDATE.json", lambda doc: {**doc, "run": "/etc"})
    return "CANDIDATE.json: run: String should match pattern"


def _run_linked_to_a_sibling(sweep: dict[str, Path]) -> str:
    shutil.rmtree(sweep["fp8"] / "run")
    (sweep["fp8"] / "run").symlink_to(sweep["w8a8"] / "run")
    return "leads out of the candidate's folder"


def _seed_listed_twice(sweep: dict[str, Path]) -> str:
    _json(sweep["w8a8"] / "run" / "RUN.json", lambda doc: {**doc, "seeds": [*doc["seeds"], doc["seeds"][0]]})
    return "RUN.json: (top level): seeds lists 2301 twice"


def _fixture_digest_zeroed(sweep: dict[str, Path]) -> str:
    _json(sweep["w8a8"] / "run" / "RUN.json", lambda doc: {**doc, "fixture_digest": "0" * 64})
    return "fixture_digest is not the digest of fixture_digests"


def _wall_forged_inside_its_window(sweep: dict[str, Path]) -> str:
    def change(lines: list[dict[str, Any]]) -> None:
        for line in lines:
            line.update(t_start=1000.0, t_end=1000.0 + line["wall_s"], wall_s=0.001)  # the window kept

    _lines(sweep["w8a8"] / "run" / "records.jsonl", change)
    return "is not the time between t_start and t_end"


FORGERIES: dict[str, Callable[[dict[str, Path]], str]] = {
    "compare.json edited to inside with PSNR 99": _compare_inside_psnr_99,
    "the run of another candidate's artifact": _run_of_another_artifact,
    "CANDIDATE.json's run at ../w8a8/run": _run_pointer_to_a_sibling,
    "CANDIDATE.json's run at /etc": _run_pointer_to_etc,
    "run/ a link to another candidate's run": _run_linked_to_a_sibling,
    "RUN.json lists a seed twice": _seed_listed_twice,
    "RUN.json's fixture digest zeroed": _fixture_digest_zeroed,
    "wall_s forged to 0.001 s inside an unchanged window": _wall_forged_inside_its_window,
}


def test_the_chained_sweep_is_judged(sweep: dict[str, Path], tmp_path: Path) -> None:
    result = build_report([sweep["w8a8"], sweep["fp8"]], sweep["baseline"], tmp_path / "report")
    assert result.verdicts == {"w8a8": "YES", "fp8": "NO"}


@pytest.mark.parametrize("name", list(FORGERIES))
def test_a_forged_run_is_refused_in_one_line(
    name: str, sweep: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    said = FORGERIES[name](sweep)
    out = tmp_path / "report"
    argv = ["report", str(sweep["w8a8"]), str(sweep["fp8"]), "--baseline", str(sweep["baseline"])]
    assert main([*argv, "--out", str(out), "--allow-unsealed"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("WARNING ")]
    assert len(lines) == 1 and said in lines[0], lines
    assert not out.exists()


def test_compare_refuses_a_run_whose_fixture_digest_was_zeroed(
    sweep: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    _fixture_digest_zeroed(sweep)
    run = sweep["w8a8"] / "run"
    assert (
        main(["compare", str(run), "--baseline", str(sweep["baseline"]), "--allow-unsealed", "--no-lpips"])
        == 2
    )
    lines = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("WARNING ")]
    assert len(lines) == 1 and "fixture_digest is not the digest of fixture_digests" in lines[0], lines


def test_a_candidate_holding_the_baseline_images_is_said_and_never_a_yes(
    sweep: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = sweep["w8a8"] / "run"
    for image in (run / "images").iterdir():
        if (sweep["baseline"] / "images" / image.name).is_file():  # the baseline ran out of memory at 4 refs
            shutil.copy(sweep["baseline"] / "images" / image.name, image)
    baseline = {
        (r["fixture_id"], r["seed"]): r for r in map(json.loads, (sweep["baseline"] / "records.jsonl").open())
    }

    def change(lines: list[dict[str, Any]]) -> None:  # the records made to name the copies: consistent
        for line in lines:
            copied = baseline.get((line["fixture_id"], line["seed"]), {}).get("sha256")
            line.update(sha256=copied or line["sha256"])

    _lines(run / "records.jsonl", change)
    (run / "compare.json").unlink()
    (run / "gate.json").unlink()
    assert (
        main(["compare", str(run), "--baseline", str(sweep["baseline"]), "--allow-unsealed", "--no-lpips"])
        == 0
    )
    assert "compared images are the baseline's, byte for byte" in capsys.readouterr().out
    assert main(["gate", str(run), "--baseline", str(sweep["baseline"]), "--allow-unsealed"]) in (0, 1)
    result = build_report([sweep["w8a8"]], sweep["baseline"], tmp_path / "report")
    (entry,) = result.data.document.candidates
    assert entry.verdict != "YES" and "baseline_images" in [r.code for r in entry.reasons]


def test_a_compare_json_whose_thresholds_were_lowered_is_judged_at_the_reports_own(
    sweep: dict[str, Path], tmp_path: Path
) -> None:
    """Its rows as computed, its lossless thresholds lowered and its decisions edited to inside: the report derives
    the decisions again, at 40 dB and 0.98."""

    def change(doc: dict[str, Any]) -> None:
        doc["lossless"].update(psnr_db=1.0, ssim=0.0, inside=True, decision="inside")
        for entry in doc["fixtures"].values():
            decision = entry["lossless"]
            decision["psnr_db"].update(threshold=1.0, decision="inside")
            decision["ssim"].update(threshold=0.0, decision="inside")
            decision["decision"] = "inside"

    _json(sweep["fp8"] / "run" / "compare.json", change)
    result = build_report([sweep["fp8"]], sweep["baseline"], tmp_path / "report")
    (candidate,) = [c for c in result.data.all_candidates if c.name == "fp8"]
    assert candidate.run is not None
    decisions = [e.lossless for e in candidate.run.parity_fixtures.values() if e.lossless is not None]
    assert decisions and all(d.psnr_db.threshold == 40.0 and d.ssim.threshold == 0.98 for d in decisions)
