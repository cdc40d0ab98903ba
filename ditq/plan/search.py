"""From measured sensitivity to an assignment: predict the end-to-end PSNR of a mix, and search for the cheapest.

**Prediction.** Quantization errors of different layers are close to independent, so their powers add: with
``e[l, s, f]`` the proxy error of layer ``l`` alone under scheme ``s`` on fixture ``f`` (a relative L2 error of
the component's output), a mix is predicted at::

    PSNR_f(mix) = offset_f - 10 log10( sum over quantized layers l of e[l, mix[l], f]^2 )

``offset_f`` is calibrated per fixture on the units whose final images were measured (blocks and the whole
component, under every scheme): the median of ``PSNR_f + 10 log10(sum of their layers' e^2)``. The calibration
absorbs how the proxy's error grows into the image's over the remaining steps and how far additivity holds; its
spread says how well the proxy predicts (``Calibration.residual_db``), and the rank correlation of proxy and PSNR
over the measured units says whether it orders them as the images do (``Calibration.spearman``).

**Search.** Each layer's options, cheapest first, are the schemes in the order given (fastest first), then
``keep``. Every layer starts at the first scheme. While a fixture is predicted below its target, the move with the
largest gain per parameter is taken, where the gain is the error power it removes from the fixtures still below
target, each relative to the error power that fixture may hold: first only moves to a slower scheme, and only
when none helps any more, moves to ``keep``; a move that would take the mix over its ``Budget`` (what each layer
costs at each option: kept parameters, or stored bytes) is not taken. Then, largest layers first,
each layer is moved back to the cheapest option that keeps every prediction on target. The predictions are only
predictions: the planner runs the final mix end to end and, where it falls short, corrects the offsets by what it
measured and searches again (``ditq.plan.planner``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ditq.judge.compare import PSNR_CAP_DB
from ditq.quantization.plan_file import KEEP

__all__ = ["Budget", "Calibration", "ProxyTable", "calibrate", "predict", "search_assignment", "spearman"]

# (layer, scheme) -> fixture -> proxy error of that layer alone
ProxyTable = Mapping[tuple[str, str], Mapping[str, float]]


@dataclass(frozen=True)
class Calibration:
    offset_db: dict[str, float]  # per fixture
    residual_db: float | None  # median absolute error of the fitted prediction over the measured units
    spearman: float | None  # rank correlation of -proxy and PSNR over the measured units and fixtures
    points: int


@dataclass(frozen=True)
class Budget:
    """What a mix may cost at most: the sum over layers of ``cost[layer][option]`` (an option not listed costs
    nothing) stays at or under ``limit``. ``--budget P%``: a kept layer costs its parameters; ``--budget SIZE``:
    every option costs its stored bytes (``ditq.checkpoint.stored.stored_bytes``; kept, the source's)."""

    cost: Mapping[str, Mapping[str, int]]
    limit: int

    def of(self, layer: str, option: str) -> int:
        return self.cost[layer].get(option, 0)

    def spent(self, mix: Mapping[str, str]) -> int:
        return sum(self.of(layer, option) for layer, option in mix.items())


def _power(errors: Sequence[float]) -> float:
    return float(sum(e * e for e in errors))


def _ranks(values: Sequence[float]) -> np.ndarray:
    order = np.argsort(values, kind="stable")
    ranks = np.empty(len(values))
    ranks[order] = np.arange(len(values))
    for value in set(values):  # ties share their mean rank
        tied = [i for i, v in enumerate(values) if v == value]
        ranks[tied] = ranks[tied].mean()
    return ranks


def spearman(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Spearman's rank correlation (None under three points or a constant side)."""
    if len(x) < 3:
        return None
    rx, ry = _ranks(x), _ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return None
    return float(np.corrcoef(rx, ry)[0, 1])


def calibrate(
    layer_proxy: ProxyTable,
    unit_layers: Mapping[str, Sequence[str]],
    unit_proxy: ProxyTable,
    unit_psnr: ProxyTable,
    fixtures: Sequence[str],
) -> Calibration:
    """Fit ``offset_f`` from the units with measured images (``unit_psnr``: (unit, scheme) -> fixture -> dB).

    A unit's error power is the sum of its layers' (``layer_proxy``), as the prediction adds them; images at
    compare's PSNR cap (identical) carry no information and are left out."""
    samples: dict[str, list[tuple[float, float]]] = {f: [] for f in fixtures}  # fixture -> (power, psnr)
    own_proxy, measured = [], []
    for (unit, scheme), per_fixture in unit_psnr.items():
        for fixture, db in per_fixture.items():
            power = _power([layer_proxy[(layer, scheme)][fixture] for layer in unit_layers[unit]])
            if power > 0 and db < PSNR_CAP_DB:
                samples[fixture].append((power, db))
                own_proxy.append(-unit_proxy[(unit, scheme)][fixture])
                measured.append(db)
    offsets = {}
    for fixture, points in samples.items():
        offsets[fixture] = (
            statistics.median(db + 10 * math.log10(power) for power, db in points) if points else PSNR_CAP_DB
        )
    residuals = [
        abs(offsets[f] - 10 * math.log10(power) - db) for f, points in samples.items() for power, db in points
    ]
    return Calibration(
        offset_db={f: round(v, 3) for f, v in offsets.items()},
        residual_db=round(statistics.median(residuals), 3) if residuals else None,
        spearman=spearman(own_proxy, measured),
        points=len(measured),
    )


def predict(
    assignment: Mapping[str, str], layer_proxy: ProxyTable, offset_db: Mapping[str, float]
) -> dict[str, float]:
    """Per fixture, the predicted PSNR (dB) of ``assignment`` (layer -> scheme or keep)."""
    out = {}
    for fixture, offset in offset_db.items():
        power = _power([layer_proxy[(name, s)][fixture] for name, s in assignment.items() if s != KEEP])
        out[fixture] = PSNR_CAP_DB if power <= 0 else min(offset - 10 * math.log10(power), PSNR_CAP_DB)
    return out


def _allowed_power(offset_db: Mapping[str, float], target_db: Mapping[str, float]) -> dict[str, float]:
    """Per fixture, the error power that still meets its target."""
    return {f: 10 ** ((offset_db[f] - target_db[f]) / 10) for f in target_db}


def search_assignment(
    layers: Mapping[str, int],
    schemes: Sequence[str],
    layer_proxy: ProxyTable,
    offset_db: Mapping[str, float],
    target_db: Mapping[str, float],
    budget: Budget | None = None,
) -> dict[str, str]:
    """The cheapest assignment (layer -> scheme or keep) predicted to meet every fixture's target, or the
    closest the moves allowed within ``budget``. ``layers``: name -> parameters."""
    options = [*schemes, KEEP]
    assignment = dict.fromkeys(layers, schemes[0])
    allowed = _allowed_power(offset_db, target_db)

    def power(f: str, mix: Mapping[str, str]) -> float:
        return _power([layer_proxy[(name, s)][f] for name, s in mix.items() if s != KEEP])

    def affordable(mix: Mapping[str, str], layer: str, option: str) -> bool:
        """Whether moving ``layer`` to ``option`` keeps ``mix`` within the budget (or costs nothing more)."""
        if budget is None:
            return True
        more = budget.of(layer, option) - budget.of(layer, mix[layer])
        return more <= 0 or budget.spent(mix) + more <= budget.limit

    def failing(mix: Mapping[str, str]) -> list[str]:
        return [f for f in target_db if power(f, mix) > allowed[f]]

    def error(layer: str, option: str, f: str) -> float:
        return 0.0 if option == KEEP else layer_proxy[(layer, option)][f] ** 2

    for allow_keep in (False, True):
        while below := failing(assignment):
            best: tuple[float, str, str] | None = None
            for layer, current in assignment.items():
                index = options.index(current)
                moves = options[index + 1 : index + 2]  # the next option down the list
                if allow_keep and current != KEEP and KEEP not in moves:
                    moves.append(KEEP)  # once schemes no longer help: straight to keep
                for option in moves:
                    if (option == KEEP and not allow_keep) or not affordable(assignment, layer, option):
                        continue
                    gain = sum(
                        (error(layer, current, f) - error(layer, option, f)) / allowed[f] for f in below
                    )
                    score = gain / max(layers[layer], 1)
                    if gain > 0 and (best is None or score > best[0]):
                        best = (score, layer, option)
            if best is None:
                break
            assignment[best[1]] = best[2]
    # Back to the cheapest option that still meets every target, largest layers first.
    if not failing(assignment):
        for layer in sorted(assignment, key=lambda name: (-layers[name], name)):
            position = options.index(assignment[layer])
            for option in options[:position]:
                trial = {**assignment, layer: option}
                if affordable(assignment, layer, option) and not failing(trial):
                    assignment[layer] = option
                    break
    return assignment
