from __future__ import annotations

from pathlib import Path

import pytest

from .synthetic import RunSpec, write_run

WALLS = {1: 2.0, 2: 2.5, 3: 3.0, 4: 3.5}


def make_runs(root: Path) -> dict[str, Path]:
    """A BF16 baseline that runs out of memory at 4 references, and three candidates."""
    baseline = write_run(
        root, RunSpec("bf16", "baseline", WALLS, oom_refs=(4,), memory_mib=(100, 900, 1500, 800))
    )
    return {
        "baseline": baseline,
        "w8a8": write_run(
            root,
            RunSpec("w8a8", "healthy", {k: v * 0.7 for k, v in WALLS.items()}, memory_mib=(80, 700, 900)),
            baseline,
        ),
        "fp8": write_run(root, RunSpec("fp8", "collapsed", {k: v * 0.6 for k, v in WALLS.items()}), baseline),
        "w8a16": write_run(
            root,
            RunSpec("w8a16", "healthy", {k: v * 1.5 for k, v in WALLS.items()}, oom_refs=(4,)),
            baseline,
        ),
    }


@pytest.fixture
def runs(tmp_path: Path) -> dict[str, Path]:
    return make_runs(tmp_path / "runs")


@pytest.fixture(scope="module")
def shared_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same runs, built once per module for tests that only read them."""
    return make_runs(tmp_path_factory.mktemp("runs"))
