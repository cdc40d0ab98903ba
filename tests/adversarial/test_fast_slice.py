"""A fast slice of the adversarial suite, run by ``make test``: one case of each family that needs only the demo model
and its artifact, through the real CLI in a subprocess, as ``make test-attacks`` runs all 171 (6 minutes on 2 cores,
so CI runs it apart)."""

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
