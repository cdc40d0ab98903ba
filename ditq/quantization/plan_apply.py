"""A plan applied to one component: the structural rule's targets narrowed to the layers the plan quantizes.

The rule (``ditq.quantization.targets.plan_targets``) still decides what *can* be quantized; the plan decides what is, and
with which scheme. A layer the plan marks ``keep``, and a plannable layer it does not name, stay in the source
precision (listed in ``ignore`` with that reason). A planned layer the rule refuses, or that the component does
not have, is an InputError naming the plan's field (``layers.<name>``).
"""

from __future__ import annotations

import difflib

from ditq.errors import InputError
from ditq.quantization.plan_file import KEEP, PlanFile
from ditq.quantization.targets import TargetPlan
from ditq.schemes import Scheme, get_scheme

__all__ = ["KEPT_BY_PLAN", "NOT_IN_PLAN", "apply_plan"]

KEPT_BY_PLAN = "plan: keep"
NOT_IN_PLAN = "plan: not named by the plan"


def _unknown(name: str, rule: TargetPlan, where: str) -> InputError:
    close = difflib.get_close_matches(name, [*rule.targets, *rule.ignored], n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return InputError(f"{where}: layers.{name}: {rule.component} has no layer of that name{hint}")


def apply_plan(rule: TargetPlan, plan: PlanFile, where: str) -> tuple[TargetPlan, dict[str, Scheme]]:
    """(the targets the plan quantizes, every other layer ignored with its reason; target -> its scheme).

    ``rule`` is the structural rule's outcome for ``plan.component``; ``where`` names the plan in errors (its
    path as given). ``rule`` is not changed.
    """
    for name, choice in sorted(plan.layers.items()):
        if name not in rule.targets and name not in rule.ignored:
            raise _unknown(name, rule, where)
        if choice != KEEP and name in rule.ignored:
            raise InputError(
                f"{where}: layers.{name}: the quantizer keeps it in source precision ({rule.ignored[name]}); "
                f"plan it as {KEEP!r} or leave it out"
            )
    # a 4-bit scheme as it fits the layer (``Scheme.fitted``), as ``TargetPlan.uniform`` fits it
    schemes = {
        name: get_scheme(choice).fitted(rule.targets[name].in_features)
        for name, choice in plan.layers.items()
        if choice != KEEP
    }
    if not schemes:
        raise InputError(
            f"{where}: layers: the plan quantizes no layer of {rule.component} (every one is keep)"
        )
    ignored = dict(rule.ignored)
    for name in rule.targets:
        if name not in schemes:
            ignored[name] = KEPT_BY_PLAN if plan.layers.get(name) == KEEP else NOT_IN_PLAN
    targets = {name: layer for name, layer in rule.targets.items() if name in schemes}
    narrowed = TargetPlan(rule.component, targets, dict(sorted(ignored.items())), list(rule.block_lists))
    return narrowed, {name: schemes[name] for name in targets}
