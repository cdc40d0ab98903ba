"""The search on hand-made sensitivity tables: predictions written out as arithmetic, the cheapest mix per target."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from ditq.plan.search import Budget, calibrate, predict, search_assignment, spearman
from ditq.quantization.plan_file import KEEP

FIXTURES = ("a", "b")
SCHEMES = ("fp8", "w8a8")
# Five layers, one of them (l3) ten times as sensitive as the rest; w8a8 a third of fp8's error everywhere.
ERRORS = {"l0": 0.001, "l1": 0.001, "l2": 0.001, "l3": 0.01, "l4": 0.001}
PARAMS = dict.fromkeys(ERRORS, 1000)
TABLE = {
    (layer, scheme): {
        f: e * (1.0 if scheme == "fp8" else 1 / 3) * (1.0 if f == "a" else 0.5) for f in FIXTURES
    }
    for layer, e in ERRORS.items()
    for scheme in SCHEMES
}
OFFSET = {"a": 0.0, "b": 0.0}


def _psnr(offset: float, errors: list[float]) -> float:
    return offset - 10 * math.log10(sum(e * e for e in errors))


def test_prediction_adds_error_powers():
    mix = {"l0": "fp8", "l1": "w8a8", "l2": KEEP, "l3": KEEP, "l4": "fp8"}
    predicted = predict(mix, TABLE, {"a": 10.0, "b": 20.0})
    assert predicted["a"] == pytest.approx(_psnr(10.0, [0.001, 0.001 / 3, 0.001]))
    assert predicted["b"] == pytest.approx(_psnr(20.0, [0.0005, 0.0005 / 3, 0.0005]))


def test_everything_kept_is_predicted_at_the_cap():
    assert predict(dict.fromkeys(ERRORS, KEEP), TABLE, OFFSET) == {"a": 100.0, "b": 100.0}


def test_a_loose_target_leaves_every_layer_at_the_fastest_scheme():
    everything_fp8 = _psnr(0.0, list(ERRORS.values()))  # fixture a is the worse one
    mix = search_assignment(PARAMS, SCHEMES, TABLE, OFFSET, {"a": everything_fp8 - 0.1, "b": 0.0})
    assert mix == dict.fromkeys(ERRORS, "fp8")


def test_the_sensitive_layer_moves_first_and_alone():
    # l3 at w8a8 instead of fp8 lowers fixture a's error power from 1.04e-4 to 1.51e-5: aim between.
    with_l3_w8a8 = _psnr(0.0, [0.001] * 4 + [0.01 / 3])
    mix = search_assignment(PARAMS, SCHEMES, TABLE, OFFSET, {"a": with_l3_w8a8 - 0.01, "b": 0.0})
    assert mix == {**dict.fromkeys(ERRORS, "fp8"), "l3": "w8a8"}


def test_keep_only_when_no_scheme_is_enough():
    all_w8a8 = _psnr(0.0, [0.001 / 3] * 4 + [0.01 / 3])
    mix = search_assignment(PARAMS, SCHEMES, TABLE, OFFSET, {"a": all_w8a8 + 3.0, "b": 0.0})
    assert mix["l3"] == KEEP
    assert predict(mix, TABLE, OFFSET)["a"] >= all_w8a8 + 3.0
    # what is not kept is at the cheapest scheme that still meets the target (the final pass)
    for layer, choice in mix.items():
        if choice == "w8a8":
            cheaper = {**mix, layer: "fp8"}
            assert predict(cheaper, TABLE, OFFSET)["a"] < all_w8a8 + 3.0


def test_the_budget_caps_what_is_kept():
    kept = Budget({name: {KEEP: n} for name, n in PARAMS.items()}, 2000)
    mix = search_assignment(PARAMS, SCHEMES, TABLE, OFFSET, {"a": 200.0, "b": 0.0}, kept)
    assert sum(PARAMS[name] for name, choice in mix.items() if choice == KEEP) == 2000


def test_a_byte_budget_holds_back_moves_to_wider_schemes():
    # fp8 costs 1 byte a weight here, w8a8 2, keep 4: room for one layer at w8a8 and none kept
    costs = {name: {"fp8": n, "w8a8": 2 * n, KEEP: 4 * n} for name, n in PARAMS.items()}
    room = Budget(costs, sum(PARAMS.values()) + 1000)
    mix = search_assignment(PARAMS, SCHEMES, TABLE, OFFSET, {"a": 200.0, "b": 0.0}, room)
    assert room.spent(mix) <= room.limit
    assert sorted(mix.values()) == ["fp8"] * 4 + ["w8a8"]
    assert mix["l3"] == "w8a8"  # the most sensitive layer gets the room


def test_calibration_recovers_the_offset_from_measured_units():
    unit_layers = {"block0": ("l0", "l1"), "block1": ("l2", "l3", "l4")}
    offsets = {"a": 7.5, "b": 9.0}
    unit_proxy = {
        (unit, s): {f: math.sqrt(sum(TABLE[(name, s)][f] ** 2 for name in layers)) for f in FIXTURES}
        for unit, layers in unit_layers.items()
        for s in SCHEMES
    }
    unit_psnr = {
        key: {f: offsets[f] - 20 * math.log10(error) for f, error in per_fixture.items()}
        for key, per_fixture in unit_proxy.items()
    }
    fit = calibrate(TABLE, unit_layers, unit_proxy, unit_psnr, FIXTURES)
    assert fit.offset_db == pytest.approx(offsets, abs=1e-3)
    assert fit.residual_db == pytest.approx(0.0, abs=1e-3)
    assert fit.spearman == pytest.approx(1.0)
    assert fit.points == 8


def test_spearman_against_its_definition():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ranks (1, 2, 3, 4) and (2, 1, 4, 3): 1 - 6 * sum(d^2) / (n (n^2 - 1)) = 1 - 6 * 4 / 60
    assert spearman([1, 2, 3, 4], [2, 1, 4, 3]) == pytest.approx(1 - 24 / 60)
    assert spearman([1, 2], [1, 2]) is None


def test_past_max_layers_the_most_sensitive_blocks_are_measured_and_the_rest_estimated():
    from ditq.plan.planner import PlanOptions, _estimate_the_rest, _layers_to_measure
    from ditq.plan.sensitivity import Sensitivity, Unit

    layers = [
        Unit(f"b.{b}.{name}", "layer", (f"b.{b}.{name}",), p)
        for b in range(3)
        for name, p in (("x", 100), ("y", 300))
    ]
    blocks = [Unit(f"b.{b}", "block", (f"b.{b}.x", f"b.{b}.y"), 400) for b in range(3)]
    wholes = Sensitivity(
        proxy={(f"b.{b}", s): {"a": e} for b, e in enumerate((0.01, 0.04, 0.02)) for s in SCHEMES}
    )
    options = PlanOptions(model=Path(__file__).parent, out=Path("unused.json"), schemes=SCHEMES, max_layers=4)
    chosen = _layers_to_measure(layers, blocks, wholes, options)
    assert [u.name for u in chosen] == ["b.1.x", "b.1.y", "b.2.x", "b.2.y"]  # the two most sensitive blocks

    measured = Sensitivity(proxy={(u.name, s): {"a": 0.001} for u in chosen for s in SCHEMES})
    _estimate_the_rest(measured, layers, blocks, wholes, SCHEMES)
    assert measured.estimated == {"b.0.x", "b.0.y"}
    # block b.0's error power 0.01^2 split 1:3 by parameters
    assert measured.proxy[("b.0.x", "fp8")]["a"] == pytest.approx(math.sqrt(1e-4 / 4))
    assert measured.proxy[("b.0.y", "w8a8")]["a"] == pytest.approx(math.sqrt(3e-4 / 4))
    assert measured.proxy[("b.1.x", "fp8")]["a"] == 0.001  # measured ones untouched


def test_the_kept_round_is_the_cheapest_that_passed():
    """Among rounds that met the target: the most quantized, then the most parameters at the fastest scheme,
    then at the next; the later round among equals."""
    from ditq.plan.planner import _cheapest

    targets = {"a": 100, "b": 10, "c": 10}
    schemes = ("fp8", "w8a8", "w8a16")
    slower = {"a": "w8a16", "b": "w8a8", "c": "fp8"}  # everything quantized
    faster = {"a": "fp8", "b": "w8a16", "c": "w8a16"}  # everything quantized, the big layer at fp8
    kept = {"a": "fp8", "b": "fp8", "c": KEEP}  # faster still, but less quantized
    assert _cheapest([slower, faster, kept], targets, schemes) == 1
    assert _cheapest([faster, slower], targets, schemes) == 0
    assert _cheapest([kept], targets, schemes) == 0
    assert _cheapest([faster, dict(faster)], targets, schemes) == 1  # equals: the later
    middle = {"a": "w8a8", "b": "fp8", "c": "fp8"}  # fp8 20 vs slower's 10
    assert _cheapest([middle, slower], targets, schemes) == 0
