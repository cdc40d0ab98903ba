"""A probe killed mid-run resumes: no duplicate records, nothing lost, a torn line repaired."""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from harness_kit import probe_argv, probe_run
from stub_images_server import StubServer, StubState

from ditq.probe.records import is_success, read_records


def test_killed_probe_resumes_without_duplicates(tmp_path: Path, fixture_set) -> None:
    out = tmp_path / "run"
    records_file = out / "records.jsonl"
    with StubServer(StubState(delay_s=0.3)) as server:
        command = [sys.executable, "-m", "ditq.cli", *probe_argv(server.url, fixture_set, out, seeds="1-3")]
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            deadline = time.time() + 60
            while not (records_file.exists() and len(records_file.read_text().splitlines()) >= 2):
                assert process.poll() is None, process.communicate()
                assert time.time() < deadline, "the probe wrote no records"
                time.sleep(0.05)
        finally:
            process.kill()  # SIGKILL: no cleanup of any kind
            process.wait()
        written = read_records(out)
        assert 2 <= len(written) < 9
        with open(records_file, "a") as handle:  # as if the kill had torn a line in half
            handle.write('{"fixture_id": "edit-two", "se')

        served_before = len(server.state.requests)
        summary = probe_run(server.url, fixture_set, out, [1, 2, 3])
        served_after = len(server.state.requests)

    records = read_records(out)
    keys = Counter(r.key for r in records)
    assert len(keys) == 9 and max(keys.values()) == 1, keys
    assert all(is_success(r) for r in records)
    assert summary.skipped == len(written) and summary.completed == 9 - len(written)
    assert served_after - served_before == 9 - len(written)  # nothing done twice by the rerun
    assert records_file.read_text().endswith("}\n")
    assert len(list((out / "images").glob("*.png"))) == 9
    assert not list((out / "images").glob(".ditq-tmp-*"))


def test_a_whole_last_record_without_its_newline_is_kept_on_resume(
    tmp_path: Path, fixture_set, stub: StubServer
) -> None:
    """A kill between a record's closing brace and its newline: the record is whole, so the resume counts it as
    done and keeps it (the newline added); it is neither redone nor cut."""
    out = tmp_path / "run"
    records_file = out / "records.jsonl"
    probe_run(stub.url, fixture_set, out, [1])
    records_file.write_bytes(records_file.read_bytes().removesuffix(b"\n"))
    last = read_records(out)[-1]

    served_before = len(stub.state.requests)
    summary = probe_run(stub.url, fixture_set, out, [1, 2])

    assert (summary.skipped, summary.completed) == (3, 3)
    assert len(stub.state.requests) - served_before == 3  # seed 2 only
    records = read_records(out)
    assert len(records) == 6 and len({r.key for r in records}) == 6 and last in records
    assert records_file.read_text().endswith("}\n") and "}{" not in records_file.read_text()
