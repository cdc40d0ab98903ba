"""A probe never reports a run it did not finish: a write error fails it loudly, two probes cannot share a run
directory, a server that went away is waited for, and the gate refuses a run that is not complete."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from harness_kit import probe_argv, probe_run
from stub_images_server import StubServer, StubState

import ditq.probe.runner
from ditq.cli import main
from ditq.errors import DitqError
from ditq.probe.records import RecordLog, is_success, read_records

ALL_KEYS = 12  # the tiny fixture set's three fixtures x seeds 1-4


def _run_json(out: Path) -> dict[str, Any]:
    return json.loads((out / "RUN.json").read_text())


def _error_line(capsys: pytest.CaptureFixture[str]) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


class _DiskThatFills:
    """records.jsonl's file object on a disk with room for ``room`` more lines: the write that finds it full
    writes part of its line, as write(2) does, and every write after that raises ENOSPC."""

    def __init__(self, handle: Any, room: int) -> None:
        self.handle, self.room, self.full = handle, room, False

    def write(self, data: bytes) -> int:
        if self.full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if self.room == 0:
            self.full = True
            return int(self.handle.write(data[: len(data) // 2]))
        self.room -= 1
        return int(self.handle.write(data))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.handle, name)


class _FullDiskLog(RecordLog):
    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self._handle = _DiskThatFills(self._handle, room=3)


def test_a_full_disk_fails_the_run_and_the_gate_refuses_it(
    tmp_path: Path, fixture_set, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    with StubServer() as server:
        with monkeypatch.context() as patch:
            patch.setattr(ditq.probe.runner, "RecordLog", _FullDiskLog)
            with pytest.raises(
                DitqError, match=r"records\.jsonl: cannot write a record \(No space left on device\)"
            ):
                probe_run(server.url, fixture_set, out, [1, 2, 3, 4])
        run = _run_json(out)
        assert run["status"] == "failed" and "No space left on device" in run["failure"]
        assert run["counts"]["completed"] == 3
        # the line the disk cut short was taken back: three whole records, nothing half-written after them
        assert len(read_records(out)) == 3 and (out / "records.jsonl").read_text().endswith("}\n")

        assert main(["gate", str(out)]) == 2
        line = _error_line(capsys)
        assert (
            str(out) in line
            and "'failed'" in line
            and f"9 of {ALL_KEYS} planned requests have no record" in line
        )
        assert not (out / "gate.json").exists()

        # with room on the disk again, the same command finishes the run
        summary = probe_run(server.url, fixture_set, out, [1, 2, 3, 4])
    assert (summary.skipped, summary.completed) == (3, 9)
    assert _run_json(out)["status"] == "complete" and "failure" not in _run_json(out)
    assert Counter(r.key for r in read_records(out)).most_common(1)[0][1] == 1
    assert main(["gate", str(out)]) == 0


def test_a_write_error_fails_ditq_probe_with_a_nonzero_exit(tmp_path: Path, fixture_set) -> None:
    """The issue's case: `ditq probe` itself, its files limited (RLIMIT_FSIZE) so that records.jsonl cannot grow
    past a few records while RUN.json and every image still fit."""
    out = tmp_path / "run"
    limit_bytes = 6000  # RUN.json is ~2 KB, an image ~4 KB, a record ~0.7 KB: records.jsonl fills first
    code = (
        "import resource, sys\n"
        f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit_bytes}, {limit_bytes}))\n"
        "from ditq.cli import main\n"
        "raise SystemExit(main(sys.argv[1:]))\n"
    )
    with StubServer() as server:
        argv = probe_argv(server.url, fixture_set, out)
        done = subprocess.run(
            [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=300
        )
    assert done.returncode != 0
    errors = done.stderr.strip().splitlines()
    assert (
        errors[-1].startswith("ditq probe: error: ") and "records.jsonl: cannot write a record" in errors[-1]
    )
    assert _run_json(out)["status"] == "failed"
    assert 0 < len(read_records(out)) < ALL_KEYS

    gate = subprocess.run(
        [sys.executable, "-m", "ditq.cli", "gate", str(out)], capture_output=True, text=True, timeout=300
    )
    assert gate.returncode == 2 and "not complete" in gate.stderr and "PASS" not in gate.stdout


def test_a_run_is_complete_only_when_every_planned_request_has_a_record(
    tmp_path: Path, fixture_set, stub: StubServer, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    probe_run(stub.url, fixture_set, out, [1, 2, 3, 4])
    assert main(["gate", str(out)]) == 0
    capsys.readouterr()
    lines = (out / "records.jsonl").read_text().splitlines(keepends=True)
    (out / "records.jsonl").write_text("".join(lines[:-1]))  # RUN.json still says complete
    lost = json.loads(lines[-1])
    assert main(["gate", str(out)]) == 2
    line = _error_line(capsys)
    assert (
        f"1 of {ALL_KEYS} planned requests have no record (first: {lost['fixture_id']} s{lost['seed']})"
        in line
    )


def test_a_second_probe_on_the_same_out_is_refused(
    tmp_path: Path, fixture_set, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    state = StubState(hold=threading.Event())
    with StubServer(state) as server:
        first = subprocess.Popen(
            [sys.executable, "-m", "ditq.cli", *probe_argv(server.url, fixture_set, out)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        try:
            while not state.requests:  # its first request is held by the server: it holds the directory
                assert first.poll() is None, first.communicate()
                time.sleep(0.05)
            assert main(probe_argv(server.url, fixture_set, out)) == 2
            line = _error_line(capsys)
            assert line.startswith("ditq probe: error: ") and str(out) in line and "another probe" in line
            assert len(state.requests) == 1  # the second probe sent nothing
        finally:
            assert state.hold is not None
            state.hold.set()
            first.communicate(timeout=300)
    assert first.returncode == 0
    records = read_records(out)
    assert len(records) == ALL_KEYS and len({r.key for r in records}) == ALL_KEYS
    assert _run_json(out)["status"] == "complete"


def test_a_server_that_went_away_is_waited_for(tmp_path: Path, fixture_set) -> None:
    """The server stops after its first answer and comes back on the same port: the probe polls /health until it
    answers and sends the request that found it gone again, so no request is recorded as failed."""
    out = tmp_path / "run"
    held = StubState(hold=threading.Event())
    first = StubServer(held).__enter__()
    result: dict[str, Any] = {}

    def probe() -> None:
        result["summary"] = probe_run(first.url, fixture_set, out, [1, 2, 3, 4], server_wait_s=120)

    thread = threading.Thread(target=probe)
    thread.start()
    while not held.requests:  # the first request is in the server, held
        assert thread.is_alive()
        time.sleep(0.02)
    first.server.should_exit = True
    while _listening(first.port):  # it takes no new connections ...
        time.sleep(0.01)
    assert held.hold is not None
    # the port held at once: the probe finds it gone before a server is back on it
    with _HangingUp(first.port) as gone:
        held.hold.set()  # ... answers the one in flight, and stops
        first.thread.join(timeout=30)
        gone.wait_for_a_connection(timeout_s=60)
    with StubServer(port=first.port) as second:
        thread.join(timeout=300)
    assert not thread.is_alive()
    summary = result["summary"]
    assert (summary.completed, summary.failed) == (ALL_KEYS, 0), [r.error for r in read_records(out)]
    assert all(is_success(r) for r in read_records(out))
    assert len(held.requests) == 1 and len(second.state.requests) == ALL_KEYS - 1
    assert "/health" in second.state.paths  # the probe waited for it


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


class _HangingUp:
    """The port of a server that went away, held so that no other takes it: every connection is accepted and closed
    before a byte is answered (a lost connection to httpx, as a refused one is). The second server starts only
    once the probe has met this, so its request cannot find the new server up without having lost the old one."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._stop = threading.Event()
        self._met = threading.Event()
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> _HangingUp:
        deadline = time.monotonic() + 30
        # the first server may still hold its listening socket for a moment after it stopped accepting
        while True:
            try:
                self._sock.bind(("127.0.0.1", self.port))
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
        self._sock.listen()
        self._sock.settimeout(0.05)
        self._thread.start()
        return self

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                connection, _ = self._sock.accept()
            except TimeoutError:
                continue
            connection.close()
            self._met.set()

    def wait_for_a_connection(self, timeout_s: float) -> None:
        assert self._met.wait(timeout_s), "the probe never came back to the port after the server went away"

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._sock.close()


def test_a_server_gone_for_good_fails_the_rest_saying_so(tmp_path: Path, fixture_set) -> None:
    with StubServer() as server:
        url = server.url  # the port is closed once the server has stopped
    with pytest.raises(DitqError, match="every one of the 3 requests failed"):
        probe_run(url, fixture_set, tmp_path / "run", [1], server_wait_s=1)
    errors = [r.error or "" for r in read_records(tmp_path / "run")]
    assert len(errors) == 3 and all(e.startswith("ConnectError: ") for e in errors)
    # one wait, then the rest recorded at once, each naming it
    assert "did not answer /health for 1 s (polled with backoff)" in errors[0]
    assert all("has not answered /health since " in e for e in errors[1:])
