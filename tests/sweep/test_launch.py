"""The sweep's commands on a CPU: forked from the fork server, each still a process with its own log and exit code."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ditq.sweep import launch


def test_a_forked_command_writes_its_log_and_returns_its_exit_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = tmp_path / "no-such-artifact"
    log = tmp_path / "logs" / "verify.log"
    monkeypatch.chdir(tmp_path)  # the child works where the sweep works when it starts it
    with launch.forking(True):
        child = launch.start([sys.executable, "-m", "ditq.cli", "verify", missing.name], log)
        assert isinstance(child, launch.Child) and child.pid != os.getpid()
        assert child.wait(timeout=120) == 2  # ditq's exit code for bad input
    assert (
        log.read_text().strip().splitlines()[-1] == f"ditq verify: error: {missing.name}: no such directory"
    )
    assert child.poll() == 2


def test_other_command_lines_and_sweeps_on_an_accelerator_start_afresh(tmp_path: Path) -> None:
    script = [sys.executable, "-c", "import sys; print('own process'); sys.exit(3)"]
    with launch.forking(True):
        other = launch.start(script, tmp_path / "other.log")
    assert isinstance(other, subprocess.Popen) and other.wait(timeout=60) == 3
    assert (tmp_path / "other.log").read_text() == "own process\n"
    with launch.forking(False):  # a sweep on CUDA
        fresh = launch.start([sys.executable, "-m", "ditq.cli", "verify", "missing"], tmp_path / "fresh.log")
    assert isinstance(fresh, subprocess.Popen) and fresh.wait(timeout=120) == 2


_IN_ANOTHER_FOLDER = """
import sys
from pathlib import Path

sys.path = [p for p in sys.path if p not in ("", ".")]  # as a console script's: not the working directory
from ditq.sweep import launch

with launch.forking(True):
    child = launch.start([sys.executable, "-m", "ditq.cli", "verify", "missing"], Path("v.log"))
    sys.exit(child.wait(timeout=120))
"""


def test_a_forked_command_runs_the_sweeps_ditq_whatever_folder_it_works_in(tmp_path: Path) -> None:
    """The fork server starts in the working directory, where another ditq may lie (a checkout of another version,
    here an empty package): the child still runs the ditq the sweep runs."""
    (tmp_path / "ditq").mkdir()
    (tmp_path / "ditq" / "__init__.py").write_text("")
    sweep = subprocess.run(
        [sys.executable, "-c", _IN_ANOTHER_FOLDER], cwd=tmp_path, capture_output=True, text=True, timeout=180
    )
    assert sweep.returncode == 2, sweep.stderr
    assert (tmp_path / "v.log").read_text().strip().splitlines()[
        -1
    ] == "ditq verify: error: missing: no such directory"


def test_commands_run_beside_each_other_run_at_once_and_each_keeps_its_log_and_exit_code(
    tmp_path: Path,
) -> None:
    """``run_logged_beside``: two commands that can each end only once the other has started (each writes its own
    file, then waits for the other's) both end, with their own exit codes and logs; run one after the other,
    the first would wait out its 60 s and fail."""
    from ditq.sweep import candidate

    def waiter(mine: str, theirs: str, code: int) -> list[str]:
        body = (
            "import pathlib, sys, time; d = pathlib.Path(sys.argv[1]); (d / sys.argv[2]).touch(); "
            "t = time.monotonic()\n"
            "while not (d / sys.argv[3]).exists():\n"
            "    if time.monotonic() - t > 60: sys.exit(9)\n"
            "    time.sleep(0.05)\n"
            "print('saw', sys.argv[3]); sys.exit(int(sys.argv[4]))"
        )
        return [sys.executable, "-c", body, str(tmp_path), mine, theirs, str(code)]

    ended = candidate.run_logged_beside(
        [
            (waiter("a", "b", 0), tmp_path / "logs" / "verify.log", lambda: None),
            (waiter("b", "a", 1), tmp_path / "logs" / "doctor.log", None),
        ]
    )
    assert [code for code, _ in ended] == [0, 1]
    assert all(seconds >= 0 for _, seconds in ended)
    for stage, other in (("verify", "b"), ("doctor", "a")):
        lines = (tmp_path / "logs" / f"{stage}.log").read_text().splitlines()
        assert lines[0].startswith(f"$ {sys.executable} -c ") and lines[-1] == f"saw {other}"
