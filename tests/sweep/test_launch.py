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
