"""The collapse signatures and the gate's rules file (``ditq/judge/gate_rules.json``, or ``--rules FILE``), as data.

A *signature* is absolute: an image's structure (``ditq.metrics.structure_metrics``) shows it when every ``when``
condition holds, unless every ``unless`` condition can be evaluated and holds (a clean cut-out is not a
collapse). The server refuses (or flags) an image that shows one before answering (``ditq.runtime.images``); the
gate judges every image of a run by them and by the rules' *envelope* around the baseline (``ditq.judge.gate``).
Shared by both, so neither imports the other.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from ditq.errors import InputError
from ditq.jsonfile import loads, read_json

__all__ = ["Condition", "EnvelopeMetric", "GateRules", "Signature", "load_rules"]

_OPS: dict[str, Callable[[Any, Any], bool]] = {
    "lt": operator.lt,
    "le": operator.le,
    "gt": operator.gt,
    "ge": operator.ge,
    "eq": operator.eq,
}
_OP_TEXT = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "=="}


@dataclass(frozen=True)
class Condition:
    metric: str
    op: str
    value: Any

    def holds(self, structure: dict[str, Any]) -> bool | None:
        """True/False, or None when the structure lacks the metric."""
        if structure.get(self.metric) is None:
            return None
        return _OPS[self.op](structure[self.metric], self.value)

    def text(self, structure: dict[str, Any]) -> str:
        return f"{self.metric} {structure.get(self.metric)} {_OP_TEXT[self.op]} {self.value}"


@dataclass(frozen=True)
class Signature:
    name: str
    description: str
    when: tuple[Condition, ...]
    unless: tuple[Condition, ...] = ()

    def fires(self, structure: dict[str, Any]) -> bool | None:
        """Every ``when`` condition holds and not every ``unless`` one does; None when a ``when`` metric is missing."""
        results = [c.holds(structure) for c in self.when]
        if any(r is None for r in results):
            return None
        return all(results) and not (self.unless and all(c.holds(structure) is True for c in self.unless))

    def describe(self, structure: dict[str, Any]) -> str:
        """``name: metric value op bound, ...`` with the measured values."""
        return f"{self.name}: " + ", ".join(c.text(structure) for c in self.when)


@dataclass(frozen=True)
class EnvelopeMetric:
    metric: str
    k: float
    margin: float
    relative_margin: float


@dataclass(frozen=True)
class GateRules:
    source: str
    signatures: tuple[Signature, ...]
    envelope: tuple[EnvelopeMetric, ...]


def _conditions(where: str, raw: Any) -> tuple[Condition, ...]:
    if not isinstance(raw, list):
        raise InputError(f"{where}: expected a list of conditions")
    out = []
    for item in raw:
        ops = [k for k in item if k != "metric"] if isinstance(item, dict) else []
        if not isinstance(item, dict) or "metric" not in item or len(ops) != 1 or ops[0] not in _OPS:
            raise InputError(
                f"{where}: a condition is {{'metric': NAME, OP: VALUE}} with OP one of {', '.join(_OPS)}"
            )
        out.append(Condition(item["metric"], ops[0], item[ops[0]]))
    return tuple(out)


DEFAULT_RULES_SOURCE = "ditq/judge/gate_rules.json"  # how a gate's output names the rules ditq ships


def load_rules(path: Path | None = None) -> GateRules:
    """The rules file (default: the one shipped with ditq), validated."""
    if path is None:
        text, source = (
            resources.files("ditq.judge").joinpath("gate_rules.json").read_text(),
            DEFAULT_RULES_SOURCE,
        )
        raw = loads(text)
    else:
        raw, source = read_json(Path(path)), str(path)
    try:
        signatures = tuple(
            Signature(
                name=s["name"],
                description=s.get("description", ""),
                when=_conditions(f"{source}: signature {s['name']!r} 'when'", s["when"]),
                unless=_conditions(f"{source}: signature {s['name']!r} 'unless'", s.get("unless", [])),
            )
            for s in raw["signatures"]
        )
        envelope = tuple(
            EnvelopeMetric(
                m["metric"], float(m["k"]), float(m.get("margin", 0.0)), float(m.get("relative_margin", 0.0))
            )
            for m in raw.get("envelope", {}).get("metrics", [])
        )
    except (KeyError, TypeError) as error:
        raise InputError(f"{source}: malformed rules (missing or wrong field {error})") from None
    return GateRules(source, signatures, envelope)
