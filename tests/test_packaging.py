"""`pip install .` gives a working ditq: the wheel built from the source tree, installed on its own, runs on the CPU.

No network: the wheel is built with the installed setuptools (``--no-build-isolation``) and installed without its
dependencies (``--no-deps --target``); this environment's site-packages supply them. Slow: mostly the doctor's
start (importing torch and diffusers, about 6 s); the build and install take about 4 s.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "-q"]


def _data_files(package: Path) -> set[str]:
    """Every file of the package that is not Python source: the demo model, its fixtures, plans, schemas."""
    return {
        p.relative_to(package).as_posix()
        for p in package.rglob("*")
        if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts
    }


@pytest.mark.slow
def test_the_wheel_installs_and_runs_on_the_cpu(tmp_path: Path) -> None:
    clean = tmp_path / "clone"  # what a clean clone holds of the package: no caches, no build leftovers
    shutil.copytree(REPO / "ditq", clean / "ditq", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, clean / name)
    target = tmp_path / "site"
    # `pip install .`: pip builds the wheel (setuptools, PEP 517) and installs it; one pip run instead of two
    install = [
        *PIP,
        "install",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "--target",
        str(target),
        str(clean),
    ]
    subprocess.run(install, check=True, cwd=tmp_path)
    assert len(list(target.glob("ditq-*.dist-info/WHEEL"))) == 1  # installed from a wheel
    assert _data_files(target / "ditq") == _data_files(REPO / "ditq")  # the demo model and every data file

    env = {**os.environ, "PYTHONPATH": str(target), "OMP_NUM_THREADS": "1"}

    def run(*argv: str) -> str:
        done = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout

    where = run(sys.executable, "-c", "import ditq; print(ditq.__file__)")
    assert Path(where.strip()) == target / "ditq" / "__init__.py"  # the installed copy, not the source tree
    assert run(str(target / "bin" / "ditq"), "--version").strip() == "ditq 0.1.0"
    doctor = run(str(target / "bin" / "ditq"), "doctor", "--device", "cpu", "--geometry", "64x64")
    verdicts = [line.split()[2] for line in doctor.splitlines() if line.startswith("cpu-reference-")]
    assert verdicts == ["PASS"] * 5, doctor  # w8a16, w8a8, fp8, w4a16, w4a8
