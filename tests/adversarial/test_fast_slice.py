"""A fast slice of the adversarial suite, run by ``make test``: one case of each family that needs only the demo model
and its artifact, through the real CLI in a fresh subprocess, as ``attack_inputs.py --fresh`` runs all 172 (``make
test-attacks``, which CI runs apart, forks most of them from one process that has imported ditq's commands)."""

from __future__ import annotations

from pathlib import Path

import attack_inputs as attacks
import pytest

# family: case (each clean in the committed run, 2-7 s; none needs the keyed artifact, the fixtures or the runs)
SLICE = {
    "model_code": "quantize-untrusted-library",
    "safetensors": "quantize-header-length-2-62",
    "json": "verify-manifest-files-wrong-type",
    "model_index": "quantize-three-item-entry",
    "outputs": "quantize-force-into-home",
    "hub": "hub-ref-out-of-the-cache",
    "pictures": "fixtures-init-png-of-30000-squared",
}
CASES = {spec.id: spec for spec in attacks.CASES}


@pytest.fixture(scope="module")
def suite_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The suite's temporary root with the shared demo model, its artifact and its bare copy."""
    root = tmp_path_factory.mktemp("attacks")
    (root / "shared").mkdir()
    attacks.build_models(root / "shared")
    return root


def test_the_slice_is_one_case_per_family_on_models_alone() -> None:
    assert all(CASES[case].group == family for family, case in SLICE.items())
    assert all(set(CASES[case].base) <= {"source", "artifact", "bare"} for case in SLICE.values())


@pytest.mark.slow
@pytest.mark.parametrize("case", SLICE.values())
def test_a_hostile_input_is_refused_cleanly(case: str, suite_root: Path) -> None:
    row = attacks.run_case(CASES[case], suite_root, {}, slow_s=45.0)
    assert row["classification"] == "clean", row


@pytest.mark.slow
def test_a_forked_command_is_judged_as_the_fresh_one(suite_root: Path) -> None:
    """``make test-attacks`` forks most cases from one process that has imported ditq's commands
    (fork_server.py): a child exits with the command's code, its output in its own files, and at the time limit
    its process group is killed. (A server that imports ditq alone here: its children import the rest as a fresh
    command does, and the test spends no time on imports that only pay off over many cases.)"""
    forks = attacks.ForkServer(attacks.command_env(), suite_root, preload=("ditq",))
    try:
        spec = CASES["fixtures-init-eps-named-png"]  # not in the slice: each case has a folder of its own
        row = attacks.run_case(spec, suite_root, {}, slow_s=45.0, forks=forks)
        assert (row["launch"], row["classification"], row["exit_code"]) == ("forked", "clean", 2), row
        assert row["judged_line"].startswith("ditq fixtures: error: $CASE/pics/p.png: not a PNG"), row
        io = suite_root / "io"
        code, _, stdout, stderr = forks.run(["--version"], suite_root, 60, io)
        assert (code, stdout.startswith("ditq "), stderr) == (0, True, "")
        code, seconds, _, _ = forks.run(["doctor", "--device", "cpu"], suite_root, 0.5, io)
        assert code is None and seconds < 30
    finally:
        forks.close()
