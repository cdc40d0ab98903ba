"""The probe runner end to end against a live stub server on loopback."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from harness_kit import probe_argv, probe_run
from stub_images_server import StubServer, StubState

from ditq.errors import DitqError, InputError
from ditq.probe.records import is_success, read_records, read_run_file

SEED_FIELDS = (
    "fixture_id",
    "seed",
    "n_references",
    "steps",
    "true_cfg_scale",
    "size",
    "wall_s",
    "http",
    "bytes",
    "sha256",
    "structure",
    "usage",
    "metrics",
    "error",
)


def test_probe_writes_records_images_and_run_json(tmp_path: Path, fixture_set, stub: StubServer) -> None:
    out = tmp_path / "run"
    summary = probe_run(stub.url + "/v1/", fixture_set, out, [1, 2], concurrency=2)
    records = read_records(out)
    assert summary.completed == 6 and summary.failed == 0 and len(records) == 6
    assert {r.key for r in records} == {(f, s) for f in ("gen-one", "edit-one", "edit-two") for s in (1, 2)}
    lines = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert all(field in line for line in lines for field in SEED_FIELDS)
    for record in records:
        assert is_success(record) and record.structure is not None and record.metrics is not None
        image = out / "images" / f"{record.fixture_id}.s{record.seed}.png"
        assert image.is_file() and image.stat().st_size == record.bytes
        assert record.structure.opaque_fraction == 1.0
        assert record.metrics["peak_memory_mb"] == 1000.0 + record.n_references
    run = json.loads((out / "RUN.json").read_text())
    assert run["endpoints"] == [stub.url] and run["status"] == "complete" and run["steps"] == 4
    assert (
        run["memory"]["source"] in ("unavailable", "nvml", "nvidia-smi") and len(run["fixture_digest"]) == 64
    )
    sent = {(int(r["seed"]), r["n_images"]): r for r in stub.state.requests}
    edit = sent[(1, 2)]
    assert edit["num_inference_steps"] == "4" and edit["true_cfg_scale"] == "1.0" and edit["size"] == "32x32"
    assert edit["response_format"] == "b64_json" and edit["output_format"] == "png"
    assert edit["return_stage_metrics"] == "true" and edit["negative_prompt"] == "blur"
    generate = sent[(1, 0)]
    assert generate["seed"] == 1 and generate["return_stage_metrics"] is True and generate["size"] == "32x48"


def test_identical_requests_give_identical_images(tmp_path: Path, fixture_set, stub: StubServer) -> None:
    probe_run(stub.url, fixture_set, tmp_path / "a", [5])
    probe_run(stub.url, fixture_set, tmp_path / "b", [5])
    digests = [{r.fixture_id: r.sha256 for r in read_records(tmp_path / x)} for x in "ab"]
    assert digests[0] == digests[1] and len(set(digests[0].values())) == 3


def test_several_endpoints_share_one_queue(tmp_path: Path, fixture_set) -> None:
    with StubServer(StubState(delay_s=0.15)) as first, StubServer(StubState(delay_s=0.15)) as second:
        probe_run([first.url, second.url], fixture_set, tmp_path / "run", [1, 2, 3], concurrency=2)
        served = len(first.state.requests), len(second.state.requests)
    records = read_records(tmp_path / "run")
    assert len(records) == 9 and all(is_success(r) for r in records)
    assert sum(served) == 9 and min(served) >= 2
    assert {r.endpoint for r in records} == {first.url, second.url}


def test_500s_timeouts_and_refused_connections_become_records(tmp_path: Path, fixture_set) -> None:
    state = StubState(fail_seeds={2}, hang_seeds={3}, hang_s=6.0)  # hangs well past the timeout below
    out = tmp_path / "run"
    with StubServer(state) as server:
        # a timeout a loaded 2-core machine still serves the healthy seed inside (0.5 s failed one under load)
        summary = probe_run(server.url, fixture_set, out, [1, 2, 3], timeout_s=2.0, concurrency=3)
        assert summary.completed == 9 and summary.failed == 6
        by_seed = {s: [r for r in read_records(out) if r.seed == s] for s in (1, 2, 3)}
        assert all(is_success(r) for r in by_seed[1])
        assert all(
            r.http == 500 and (r.error or "").startswith("HTTP 500") and r.sha256 is None for r in by_seed[2]
        )
        assert all(r.http is None and "timeout" in (r.error or "") for r in by_seed[3])
        assert not (out / "images" / "edit-one.s2.png").exists()

        # A rerun skips every recorded key, failed ones included ...
        before = len(state.requests)
        assert probe_run(server.url, fixture_set, out, [1, 2, 3]).completed == 0
        assert len(state.requests) == before
        # ... and --retry-failed redoes only the failures.
        state.fail_seeds.clear()
        state.hang_seeds.clear()
        retried = probe_run(server.url, fixture_set, out, [1, 2, 3], retry_failed=True)
    assert (retried.completed, retried.skipped, retried.failed) == (6, 3, 0)
    assert len(read_records(out)) == 15  # 9 first attempts + 6 retries, appended


def test_refused_connection_is_a_record(tmp_path: Path, fixture_set) -> None:
    with StubServer() as server:
        url = server.url  # the port is closed once the server has stopped
    # every request failed and none ran out of memory: the run holds no evidence, so it is failed, not complete
    with pytest.raises(
        DitqError, match=r"every one of the 3 requests failed \(first: .*no answer: ConnectError"
    ):
        probe_run(url, fixture_set, tmp_path / "run", [1], timeout_s=2, server_wait_s=0)
    records = read_records(tmp_path / "run")
    assert len(records) == 3 and all("ConnectError" in (r.error or "") for r in records)
    assert read_run_file(tmp_path / "run").status == "failed"


def test_collapsed_images_are_recorded_with_their_structure(tmp_path: Path, fixture_set) -> None:
    with StubServer(StubState(collapse=True)) as server:
        probe_run(server.url, fixture_set, tmp_path / "run", [1])
    for record in read_records(tmp_path / "run"):
        assert is_success(record)  # the request worked; judging the image is the gate's job
        structure = record.structure
        assert structure is not None and structure.opaque_fraction == 0.0
        assert structure.banding_score is not None and structure.banding_score > 0.9


def test_resume_with_other_settings_is_refused(tmp_path: Path, fixture_set, stub: StubServer) -> None:
    probe_run(stub.url, fixture_set, tmp_path / "run", [1])
    from ditq.probe.runner import ProbeOptions, run_probe

    fixtures, refs = fixture_set
    with pytest.raises(InputError, match="steps=4, not 8"):
        run_probe(ProbeOptions([stub.url], fixtures, refs, [1], tmp_path / "run", steps=8, progress=False))


def test_bad_options_are_refused(tmp_path: Path, fixture_set) -> None:
    with pytest.raises(InputError, match="not an http"):
        probe_run("localhost:9", fixture_set, tmp_path / "run", [1])
    with pytest.raises(InputError, match="--only: unknown fixture 'nope'"):
        probe_run("http://127.0.0.1:9", fixture_set, tmp_path / "run", [1], only=["nope"])


def test_probe_command_exit_codes(tmp_path: Path, fixture_set, capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from ditq.commands import probe as probe_command

    def cli(url: str, *extra: str) -> int:
        parser = argparse.ArgumentParser()
        probe_command.add_arguments(parser)
        argv = probe_argv(url, fixture_set, tmp_path / "run", *extra, seeds="1,2")[
            1:
        ]  # past the word "probe"
        return probe_command.run(parser.parse_args(argv))

    state = StubState(fail_seeds={2})
    with StubServer(state) as server:
        assert cli(server.url) == 1
        assert "3/6 with an image" in capsys.readouterr().out
        state.fail_seeds.clear()
        assert cli(f"{server.url},{server.url}", "--retry-failed", "--concurrency", "2") == 0
        assert "6/6 with an image" in capsys.readouterr().out


def test_a_fixture_id_or_reference_that_names_another_folder_is_one_line_and_nothing_is_touched(
    tmp_path: Path, fixture_set, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from ditq.cli import main

    fixtures, refs = fixture_set
    secret = tmp_path / "secret.png"  # a picture outside --refs that a '../' reference would upload
    secret.write_bytes((refs / "ref-a.png").read_bytes())
    outside = tmp_path / "outside"
    cases = {
        "id": {"../outside/x": json.loads(fixtures.read_text())["gen-one"]},
        "reference": {
            "edit-one": {**json.loads(fixtures.read_text())["edit-one"], "references": ["../secret"]}
        },
    }
    with StubServer(StubState()) as server:
        for name, content in cases.items():
            evil = tmp_path / f"evil-{name}.json"
            evil.write_text(json.dumps(content))
            out = tmp_path / f"run-{name}"
            argv = probe_argv(server.url, (evil, refs), out, seeds="1")
            assert main(argv) == 2, name
            assert "is not a plain name" in capsys.readouterr().err
            assert not out.exists() and not outside.exists()
        assert server.state.requests == []  # nothing was sent, so nothing was uploaded


def test_records_of_a_parallel_server_say_its_setting_and_run_json_its_ranks(
    tmp_path: Path, fixture_set
) -> None:
    """What ``ditq serve --parallel cp=2`` says on /health (devices, degree, each rank's peak) reaches RUN.json's
    servers, and its setting every record."""
    ranks = [{"rank": r, "device": f"cuda:{r}", "pid": 100 + r, "peak_memory_bytes": 2**30} for r in range(2)]
    parallel = {"mode": "cp", "degree": 2, "backend": "nccl", "devices": ["cuda:0", "cuda:1"], "ranks": ranks}
    with StubServer(StubState(health={"status": "ready", "device": "cuda:0", "parallel": parallel})) as stub:
        probe_run(stub.url, fixture_set, tmp_path / "run", [1])
    run = read_run_file(tmp_path / "run")
    assert run is not None
    (server,) = run.invocations[0].servers
    assert server.facts is not None and server.facts.parallel is not None
    assert (server.facts.parallel.label, server.facts.parallel.ranks[1].peak_memory_bytes) == ("cp=2", 2**30)
    records = read_records(tmp_path / "run")
    assert records and {r.parallel for r in records} == {"cp=2"}


def test_a_runs_progress_reads_back_as_requests_done_and_an_eta(
    tmp_path: Path, fixture_set, stub: StubServer
) -> None:
    """What a sweep says every 10 s while a probe runs: its invocation's requests done of those planned, and the
    ETA at their mean time; a second invocation counts its own requests only."""
    from ditq.sweep.candidate import probe_news

    out = tmp_path / "run"
    assert probe_news(out) is None  # nothing written yet
    probe_run(stub.url, fixture_set, out, [1])
    news = probe_news(out)
    assert news is not None and re.fullmatch(r"3/3 requests, \d+\.\d s each, ETA 0 s", news), news
    # the first request apart, the ETA counts down while the next one runs: 2 of 3 done, the warm one's time each
    original = (out / "records.jsonl").read_text()
    records = [json.loads(line) for line in original.splitlines()]
    records[0]["wall_s"], records[1]["wall_s"] = 100.0, 2.0  # a cold first request, then a warm one
    (out / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:2]))
    end = records[1]["t_end"]
    assert probe_news(out, now=end) == "2/3 requests, 2.0 s each, ETA 2 s"
    assert probe_news(out, now=end + 1.5) == "2/3 requests, 2.0 s each, ETA 0 s"  # 0.5 s left: rounds to 0
    assert probe_news(out, now=end + 60) == "2/3 requests, 2.0 s each, ETA 0 s"  # never below nothing
    (out / "records.jsonl").write_text(original)  # as the probe wrote it: the resume below checks it
    probe_run(stub.url, fixture_set, out, [1, 2])  # resumes: 3 more planned
    assert (probe_news(out) or "").startswith("3/3 requests")
