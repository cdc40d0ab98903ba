"""A planned candidate's plan in the report: the per-layer sensitivity chart and what was kept, and why.

A sweep copies the candidate's PLAN.json (``ditq plan``) into its directory; the report reads it from there.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from ditq.quantization.plan_file import KEEP, PlanFile
from ditq.report.charts import save_chart
from ditq.report.tables import Table

__all__ = ["plan_chart", "plan_chart_name", "plan_sentences", "plan_table", "write_plan_charts"]

_MAX_ROWS = 120


def plan_chart_name(candidate: str) -> str:
    return f"plan-{candidate}.png"


def plan_chart(plan: PlanFile, path: Path) -> Path | None:
    """Layers (rows) x schemes (columns), coloured by log10 of the layer's proxy error under that scheme (worst
    fixture); the plan's choice per layer is ringed, kept layers say so on the right. None without layers."""
    rows = [entry for entry in plan.sensitivity if entry.unit == "layer"]
    if not rows:
        return None
    schemes = plan.schemes
    shown = len(rows)
    if len(rows) > _MAX_ROWS:  # a full-size model's hundreds of Linears: its most sensitive, in model order
        keep = sorted(rows, key=lambda e: -e.proxy.get(schemes[0], 0.0))[:_MAX_ROWS]
        rows = [entry for entry in rows if entry in keep]
    values = [
        [math.log10(entry.proxy[s]) if entry.proxy.get(s, 0) > 0 else math.nan for s in schemes]
        for entry in rows
    ]
    figure, axis = plt.subplots(figsize=(2.6 + 1.1 * len(schemes), 1.2 + 0.2 * len(rows)))
    image = axis.imshow(values, aspect="auto", cmap="magma_r", interpolation="nearest")
    for y, entry in enumerate(rows):
        choice = plan.layers.get(entry.layer)
        if choice in schemes:
            axis.scatter(
                [schemes.index(choice)], [y], s=60, facecolors="none", edgecolors="cyan", linewidths=1.6
            )
        elif choice == KEEP:
            axis.text(len(schemes) - 0.45, y, " keep", va="center", fontsize=7, color="black")
    axis.set_xticks(range(len(schemes)), schemes, fontsize=8)
    axis.set_yticks(range(len(rows)), [entry.layer for entry in rows], fontsize=6)
    axis.set_xlim(-0.5, len(schemes) + 0.3)
    title = "Proxy error per layer alone (log10); ringed: planned"
    if shown > len(rows):
        title += f"\nthe {len(rows)} most sensitive of {shown} under {schemes[0]}"
    axis.set_title(title, fontsize=8)
    bar = figure.colorbar(image, ax=axis, fraction=0.05)
    bar.ax.tick_params(labelsize=7)
    return save_chart(figure, path, tight_box=True)  # long layer names stay whole


def write_plan_charts(plans: dict[str, PlanFile], out_dir: Path) -> dict[str, Path | None]:
    """Candidate name -> its sensitivity chart under ``out_dir`` (keyed by ``plan_chart_name``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return {
        plan_chart_name(name): plan_chart(plan, out_dir / plan_chart_name(name))
        for name, plan in plans.items()
    }


def plan_sentences(plan: PlanFile) -> Iterator[str]:
    """The plan in sentences: the mix, the target, the end-to-end check, the proxy's validation and the cost."""
    counts = Counter(plan.layers.values())
    mix = ", ".join(f"{n} {choice}" for choice, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    yield (
        f"Planned by `ditq plan` over {len(plan.layers)} Linears of {plan.component} (candidates "
        f"{', '.join(plan.schemes)}, fastest first): {mix}; {plan.quantized_fraction:.1%} of their parameters "
        "quantized."
    )
    target = plan.target
    what = "the parity band's floor per fixture" if target.kind == "parity" else "a stated PSNR"
    floors = ", ".join(f"{f} {db:.2f}" for f, db in target.per_fixture_db.items()) or f"{target.db:.2f}"
    yield f"Target: {what} ({floors} dB against the source precision), searched {target.margin_db:g} dB above it."
    if plan.verification is not None:
        v = plan.verification
        measured = ", ".join(
            f"{f} {db:.2f}" + (f" ({v.decisions[f]})" if f in v.decisions else "")
            for f, db in v.psnr_db.items()
        )
        how = (
            "quantized with `ditq quantize --plan` and run by the runtime"
            if v.artifact
            else "built in memory"
        )
        state = "met" if v.meets_target else "NOT met"
        added = "".join(f", {len(more)} more for {f}" for f, more in v.seeds_added.items())
        yield (
            f"Checked end to end ({how}; {len(v.seeds)} seeds{added}, {v.rounds} search-and-verify rounds): "
            f"{measured} dB; target {state}."
        )
    else:
        yield "Not checked end to end: the plan carries no verification."
    if plan.calibration is not None:
        c = plan.calibration
        yield (
            f"Proxy (the component's output error over the first denoising steps) against the final image over "
            f"{c.points} measured blocks x schemes x fixtures: rank correlation {c.spearman}, predicted PSNR off "
            f"by {c.residual_db} dB (median)."
        )
    if plan.cost is not None:
        yield f"Search cost: {plan.cost.seconds:.0f} s, {plan.cost.forwards} {plan.component} forwards on {plan.cost.device}."


def plan_table(plan: PlanFile, limit: int = 40) -> Table:
    """The layers not at the fastest scheme (kept or slower), most sensitive first, with the reason."""
    proxy = {entry.layer: entry.proxy for entry in plan.sensitivity if entry.unit == "layer"}
    first = plan.schemes[0]
    moved = [layer for layer, choice in plan.layers.items() if choice != first]
    moved.sort(key=lambda layer: -proxy.get(layer, {}).get(first, 0.0))
    rows: list[tuple[str, ...]] = [
        (layer, plan.layers[layer], *(_error(proxy.get(layer, {}).get(s)) for s in plan.schemes),
         plan.reasons.get(layer, ""))
        for layer in moved[:limit]
    ]  # fmt: skip
    if len(moved) > limit:
        rows.append((f"... and {len(moved) - limit} more", "", *("" for _ in plan.schemes), ""))
    headers: Sequence[str] = ("Layer", "Planned", *(f"{s} proxy" for s in plan.schemes), "Why")
    return Table(tuple(headers), tuple(rows))


def _error(value: float | None) -> str:
    return "" if value is None else f"{value:.3g}"
