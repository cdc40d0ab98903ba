"""tests/adversarial/attack_inputs.py: how one CLI outcome is classified (the suite itself runs as `make test-attacks`)."""

from __future__ import annotations

import pytest
from attack_inputs import Outcome, classify

NAMES = ("transformer/config.json",)
ERROR = "ditq verify: error: /m/transformer/config.json: nested more than 64 deep\n"


@pytest.mark.parametrize(
    ("expect", "outcome", "label"),
    [
        ("refuse", Outcome(2, 3.0, "", ERROR), "clean"),
        (
            "refuse",
            Outcome(1, 3.0, "FAIL  transformer: config  /m/transformer/config.json: bad\n", ""),
            "clean",
        ),
        ("refuse", Outcome(2, 3.0, "", "ditq verify: error: something is wrong\n"), "weak"),
        ("refuse", Outcome(2, 99.0, "", ERROR), "weak"),
        ("refuse", Outcome(0, 3.0, "OK: 7 of 7 checks passed\n", ""), "defect"),
        ("refuse", Outcome(1, 3.0, "", "Traceback (most recent call last):\nValueError: x\n"), "defect"),
        ("refuse", Outcome(None, 60.0, "", ""), "defect"),
        ("refuse", Outcome(-6, 3.0, "", ""), "defect"),
        ("refuse", Outcome(2, 3.0, "", ERROR, marker=True), "defect"),
        ("refuse", Outcome(2, 3.0, "Do you wish to run the custom code? [y/N]", ERROR), "defect"),
        ("refuse", Outcome(2, 3.0, "", ERROR, outside=["escaped.s1.png"]), "defect"),
        ("legit", Outcome(0, 3.0, "OK\n", ""), "clean"),
        ("legit", Outcome(2, 3.0, "", ERROR), "defect"),
        ("judge", Outcome(1, 1.0, "edit-one s1: ERROR: image cannot be decoded\n", ""), "clean"),
        ("judge", Outcome(0, 1.0, "GATE: PASS\n", ""), "weak"),
    ],
)
def test_classify(expect: str, outcome: Outcome, label: str) -> None:
    names = ("cannot be decoded",) if expect == "judge" else NAMES
    assert classify("verify", expect, names, outcome, slow_s=45.0)[0] == label


def test_harmless_acceptance_is_weak_only_when_said() -> None:
    outcome = Outcome(0, 1.0, "GATE: PASS\n", "")
    assert classify("gate", "refuse", NAMES, outcome, 45.0, accepted=("weak", "lax types"))[0] == "weak"
    assert classify("gate", "refuse", NAMES, Outcome(1, 1.0, "", "Traceback (most recent call last):\n"), 45.0,
                    accepted=("weak", "lax types"))[0] == "defect"  # fmt: skip
