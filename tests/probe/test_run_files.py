"""Run files are typed on both sides: what a writer wrote reads back to the same model and the same JSON, and
a file that does not match its model is a one-line InputError naming the file and the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from harness_kit import REPO_ROOT, SEED_EVIDENCE_COPY, probe_run, served_record
from stub_images_server import StubServer

from ditq.errors import InputError
from ditq.judge.baseline import seal_run, verify_seal
from ditq.judge.compare import ParityBand, compare_run
from ditq.judge.gate import gate_run, load_rules
from ditq.probe.records import RecordLog, is_out_of_memory, read_records, read_run_file
from ditq.runfiles import (
    BASELINE_COMMANDS_FILE,
    Attempt,
    CandidateFile,
    CommandList,
    CompareFile,
    DoctorFile,
    GateFile,
    RunFile,
    SealFile,
    SweepFile,
    read_model,
    read_model_list,
    to_json,
    write_model,
)

H200_SWEEP = REPO_ROOT / "benchmarks" / "results" / "h200-full-size" / "sweep-whole"


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def judged(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A sealed baseline and a candidate run through the stub server, gated and compared by their writers."""
    from harness_kit import write_fixture_set

    root = tmp_path_factory.mktemp("runfiles")
    fixture_set = write_fixture_set(root)
    with StubServer() as server:
        probe_run(server.url, fixture_set, root / "baseline", [1, 2])
        probe_run(server.url, fixture_set, root / "run", [1, 2])
    seal_run(root / "baseline")
    rules = load_rules()
    write_model(
        root / "run" / "gate.json", gate_run(root / "run", rules, baseline_dir=root / "baseline").to_file()
    )
    band = ParityBand("stated", 30.0, {}, 1.0)
    write_model(root / "run" / "compare.json", compare_run(root / "run", root / "baseline", parity=band))
    return {"baseline": root / "baseline", "run": root / "run"}


def test_records_and_run_json_read_back_as_written(judged: dict[str, Path]) -> None:
    run = judged["run"]
    records = read_records(run)
    assert [to_json(r) for r in records] == _lines(run / "records.jsonl")
    run_file = read_run_file(run)
    assert run_file is not None and to_json(run_file) == json.loads((run / "RUN.json").read_text())
    assert run_file.status == "complete" and run_file.counts is not None and run_file.counts.completed == 6
    assert [s.endpoint for i in run_file.invocations for s in i.servers] == run_file.endpoints


def test_seal_gate_and_compare_read_back_as_written(judged: dict[str, Path]) -> None:
    for path, model in (
        (judged["baseline"] / "SEAL.json", SealFile),
        (judged["run"] / "gate.json", GateFile),
        (judged["run"] / "compare.json", CompareFile),
    ):
        assert to_json(read_model(model, path)) == json.loads(path.read_text()), path.name
    gate = read_model(GateFile, judged["run"] / "gate.json")
    assert gate.verdict == "PASS" and sorted(gate.by_references) == [0, 1, 2]
    compare = read_model(CompareFile, judged["run"] / "compare.json")
    assert compare.parity is not None and compare.parity.floor_db == 29.0 and compare.overall.ok == 6


def test_sweep_files_read_back_as_written(tmp_path: Path) -> None:
    attempts = [
        Attempt(
            offload="none", command="ditq serve --offload none", status="out_of_memory_at_load", seconds=2.0
        ),
        Attempt(
            offload="model",
            command="ditq serve",
            status="ok",
            ready_s=1.0,
            probe_command="ditq probe",
            exit_code=0,
        ),
    ]
    candidate = CandidateFile(name="w8a8", scheme="w8a8", offload=["none", "model"], attempts=attempts)
    for path, content in ((tmp_path / "CANDIDATE.json", candidate), (tmp_path / "attempts.json", attempts)):
        write_model(path, content)
    assert read_model(CandidateFile, tmp_path / "CANDIDATE.json") == candidate
    assert read_model_list(Attempt, tmp_path / "attempts.json") == attempts
    written = json.loads((tmp_path / "attempts.json").read_text())
    assert "probe_command" not in written[0] and written[1]["probe_command"] == "ditq probe"  # what was set


@pytest.mark.parametrize(
    ("name", "model"),
    [
        ("SWEEP.json", SweepFile),
        ("baseline/RUN.json", RunFile),
        ("baseline/SEAL.json", SealFile),
        ("baseline/gate.json", GateFile),  # written before gate rows said what they inherited
        ("w8a8/CANDIDATE.json", CandidateFile),
        ("w8a8/run/RUN.json", RunFile),
        ("w8a8/run/gate.json", GateFile),
        ("w8a8/run/compare.json", CompareFile),
        ("w8a8/doctor.json", DoctorFile),
        ("w8a16/doctor.json", DoctorFile),
    ],
)
def test_the_committed_h200_run_files_read_back_unchanged(name: str, model: type[Any]) -> None:
    path = H200_SWEEP / name
    assert to_json(read_model(model, path)) == json.loads(path.read_text())


def test_the_committed_h200_records_and_attempts_read_back_unchanged() -> None:
    for run in (H200_SWEEP / "baseline", H200_SWEEP / "w8a8" / "run"):
        assert [to_json(r) for r in read_records(run)] == _lines(run / "records.jsonl")
    attempts = H200_SWEEP / "logs" / "baseline-attempts.json"
    assert [to_json(a) for a in read_model_list(Attempt, attempts)] == json.loads(attempts.read_text())
    commands = H200_SWEEP / "logs" / BASELINE_COMMANDS_FILE
    assert read_model(CommandList, commands).model_dump() == json.loads(commands.read_text())


def test_the_seed_matrix_is_read_through_its_adapter(tmp_path: Path) -> None:
    records = read_records(SEED_EVIDENCE_COPY)
    assert len(records) == 16 and all(r.endpoint is None and r.invocation is None for r in records)
    assert records[0].server_peak_mib == 21594.0 and records[0].metrics is not None
    assert (
        "stage_metrics" in records[0].metrics
    )  # the response's extra metrics, merged as the probe merges them
    seed = json.loads((SEED_EVIDENCE_COPY / "matrix.json").read_text())[0]
    failed = {**seed, "http": 500, "sha256": None, "structure": None, "error": "CUDA out of memory. Tried"}
    (tmp_path / "matrix.json").write_text(json.dumps([failed]))
    (record,) = read_records(tmp_path)
    assert is_out_of_memory(record) and record.error_code == "out_of_memory"  # the seed said so in words only


def test_a_request_refused_for_memory_counts_as_out_of_memory_and_one_refused_for_time_does_not() -> None:
    # the offload ladder sends both kinds of memory failure to the next mode; a time refusal is not one
    refused = served_record("f", 1).model_copy(update={"http": 413, "sha256": None, "error": "can never run"})
    assert is_out_of_memory(refused.model_copy(update={"error_code": "over_memory_budget"}))
    assert is_out_of_memory(refused.model_copy(update={"http": 503, "error_code": "out_of_memory"}))
    assert not is_out_of_memory(refused.model_copy(update={"error_code": "over_budget"}))


def _bad_line(run: Path) -> None:
    with RecordLog(run / "records.jsonl") as log:
        log.append(served_record("f", 1))
    line = to_json(served_record("f", 2))
    with open(run / "records.jsonl", "a") as handle:
        handle.write(json.dumps({**line, "seed": "two"}) + "\n")


def _edit(path: Path, change: dict[str, Any]) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))


@pytest.mark.parametrize(
    ("file", "field", "read"),
    [
        ("records.jsonl", "line 2: seed", lambda run: read_records(run)),
        ("RUN.json", "surprise", lambda run: read_run_file(run)),
        ("gate.json", "records", lambda run: read_model(GateFile, run / "gate.json")),
        ("compare.json", "overall.ok", lambda run: read_model(CompareFile, run / "compare.json")),
        ("matrix.json", "record 0: steps", lambda run: read_records(run)),
    ],
)
def test_a_malformed_file_is_one_line_naming_file_and_field(
    judged: dict[str, Path], tmp_path: Path, file: str, field: str, read: Any
) -> None:
    import shutil

    run = tmp_path / "run"
    shutil.copytree(judged["run"], run)
    if file == "records.jsonl":
        (run / "records.jsonl").unlink()
        _bad_line(run)
    elif file == "RUN.json":
        _edit(run / "RUN.json", {"surprise": 1})
    elif file == "gate.json":
        _edit(run / "gate.json", {"records": None})
    elif file == "compare.json":
        document = json.loads((run / "compare.json").read_text())
        document["overall"]["ok"] = "all"
        (run / "compare.json").write_text(json.dumps(document))
    else:
        (run / "records.jsonl").unlink()
        (run / "matrix.json").write_text(json.dumps([{"fixture_id": "f", "seed": 1, "n_references": 1}]))
    with pytest.raises(InputError) as caught:
        read(run)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(str(run / file)) and f"{field}:" in message


def test_a_malformed_seal_is_a_problem_naming_the_field(judged: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    baseline = tmp_path / "baseline"
    shutil.copytree(judged["baseline"], baseline)
    _edit(baseline / "SEAL.json", {"files": ["records.jsonl"]})
    (problem,) = verify_seal(baseline)
    assert problem.startswith("SEAL.json is unreadable") and "files: " in problem and "\n" not in problem


def test_a_malformed_sweep_file_is_one_line_naming_file_and_field(tmp_path: Path) -> None:
    candidate = tmp_path / "CANDIDATE.json"
    candidate.write_text(json.dumps({"name": "fp8", "stages": {"serve": {"status": "crashed"}}}))
    with pytest.raises(InputError, match=r"CANDIDATE\.json: stages\.serve\.status: Input should be"):
        read_model(CandidateFile, candidate)
    attempts = tmp_path / "attempts.json"
    attempts.write_text(json.dumps([{"offload": "none", "status": "ok", "exit": 0}]))
    with pytest.raises(InputError, match=r"attempts\.json item 0: exit: Extra inputs"):
        read_model_list(Attempt, attempts)
    commands = tmp_path / BASELINE_COMMANDS_FILE
    commands.write_text(json.dumps(["ditq serve", {"command": "ditq probe"}]))
    with pytest.raises(InputError, match=r"baseline-commands\.json: 1: Input should be a valid string"):
        read_model(CommandList, commands)
    sweep = tmp_path / "SWEEP.json"
    sweep.write_text(json.dumps({"command": "ditq sweep"}))
    with pytest.raises(InputError, match=r"SWEEP\.json: model: Field required"):
        read_model(SweepFile, sweep)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ('"wall_s": -4.0', "wall_s"),
        ('"wall_s": NaN', "wall_s"),
        ('"t_end": Infinity', "t_end"),
        ('"peak_memory_mib": -1.0', "peak_memory_mib"),
        ('"n_references": -2', "n_references"),
        ('"metrics": {"denoising_ms": -300.0}', "metrics.denoising_ms"),
        ('"metrics": {"stage_peak_memory_mb": {"decoding": NaN}}', "metrics.stage_peak_memory_mb.decoding"),
        ('"metrics": {"denoise_step_latency_ms": [120.0, -1.0]}', "metrics.denoise_step_latency_ms"),
        ('"seed": 1, "seed": 2', "key 'seed' given twice"),
        ('"http": "200"', "http"),  # a number's text is not the number: integers are read strictly
        ('"seed": 1.0', "seed"),
    ],
)
def test_a_record_with_a_negative_or_non_finite_figure_or_a_repeated_key_is_refused_on_read(
    tmp_path: Path, change: str, field: str
) -> None:
    record = to_json(served_record("f", 1))
    record.pop(change.split(":", 1)[0].strip('"'))  # the line below gives the field its bad value instead
    line = (
        json.dumps(record)[:-1] + ", " + change + "}"
    )  # raw text: json.dumps would not write NaN or a twin key
    (tmp_path / "records.jsonl").write_text(json.dumps(to_json(served_record("f", 0))) + "\n" + line + "\n")
    with pytest.raises(InputError) as caught:
        read_records(tmp_path)
    message = str(caught.value)
    assert (
        message.startswith(f"{tmp_path / 'records.jsonl'} line 2")
        and field in message
        and "\n" not in message
    )


def _copy(run: Path, to: Path) -> Path:
    import shutil

    shutil.copytree(run, to)
    return to


def _write_lines(path: Path, lines: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def _report(run: Path, baseline: Path, out: Path, *flags: str) -> int:
    from ditq.cli import main

    return main(["report", str(run), "--baseline", str(baseline), "--out", str(out), *flags])


def test_a_report_over_a_negative_time_is_one_line_and_writes_no_verdict(
    judged: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _copy(judged["run"], tmp_path / "run")
    lines = _lines(run / "records.jsonl")
    lines[0]["wall_s"] = -50.0  # believed, it made the candidate 'faster: YES'
    _write_lines(run / "records.jsonl", lines)
    assert _report(run, judged["baseline"], tmp_path / "rep") == 2
    assert "line 1: wall_s: Input should be greater than or equal to 0" in capsys.readouterr().err
    assert not (tmp_path / "rep").exists()


def test_report_refuses_a_baseline_altered_since_it_was_sealed_as_gate_and_compare_do(
    judged: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    baseline = _copy(judged["baseline"], tmp_path / "baseline")
    lines = _lines(baseline / "records.jsonl")
    for line in lines:  # a baseline made 50x slower makes every candidate 'faster' (its window stretched too)
        line["wall_s"] *= 50
        line["t_end"] = line["t_start"] + line["wall_s"]
    _write_lines(baseline / "records.jsonl", lines)
    assert _report(judged["run"], baseline, tmp_path / "rep") == 1
    error = capsys.readouterr().err.strip()
    assert (
        "\n" not in error and "records.jsonl does not match its seal" in error and "--allow-unsealed" in error
    )
    assert not (tmp_path / "rep").exists()
    assert _report(judged["run"], baseline, tmp_path / "rep", "--allow-unsealed") == 0  # said, then allowed
    assert (tmp_path / "rep" / "verdict.json").is_file()


def test_a_report_over_an_image_that_cannot_be_decoded_says_so_in_its_grid_without_a_traceback(
    judged: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _copy(judged["run"], tmp_path / "run")
    image = sorted((run / "images").glob("*.png"))[0]
    image.write_bytes(image.read_bytes()[:60])  # truncated after its header
    out = tmp_path / "rep"
    # gated before the damage: its gate.json no longer holds, and the report says which image and why
    assert _report(run, judged["baseline"], out) == 2
    error = capsys.readouterr().err
    assert "Traceback" not in error and len(error.strip().splitlines()) == 1
    assert "gate.json: says" in error and "image cannot be decoded" in error
    assert not out.exists()
    # a run neither gated nor compared: the report judges what it has, and its grid says the image cannot be read
    (run / "gate.json").unlink()
    (run / "compare.json").unlink()
    assert _report(run, judged["baseline"], out) == 0
    assert "Traceback" not in capsys.readouterr().err
    assert (out / "verdict.json").is_file() and list((out / "grids").glob("*.png"))
