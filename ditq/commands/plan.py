"""`ditq plan SRC --out PLAN.json`: measured per-layer sensitivity and a mixed-precision plan, verified end to end."""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from ditq.checkpoint.hub import resolve_model
from ditq.commands import MAX_SEEDS, PLAN_SCHEMES, TOLERANCE_DB, add_load_arguments, load_options_from_args
from ditq.commands.quantize import add_rounding_arguments
from ditq.probe.fixtures import DEFAULT_SEEDS
from ditq.quantization.defaults import CALIBRATION_SEEDS, CALIBRATION_STEPS

if TYPE_CHECKING:
    from ditq.quantization.plan_file import PlanFile

__all__ = ["add_arguments", "run", "summary"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        metavar="SRC",
        help="the diffusers model directory (the bundled demo model: its path) or hub id (org/name[@revision], through the hub cache)",
    )
    parser.add_argument(
        "--out", type=Path, required=True, metavar="PLAN.json", help="where to write the plan"
    )
    parser.add_argument(
        "--fixtures", type=Path, help="fixtures file (default for the bundled demo model: the demo's own)"
    )
    parser.add_argument("--refs", type=Path, help="reference image folder (default: the demo's own)")
    parser.add_argument(
        "--schemes",
        default=",".join(PLAN_SCHEMES),
        help=f"candidate schemes, fastest first (default: {','.join(PLAN_SCHEMES)}); a layer gets the first "
        "that keeps the target, else stays in source precision",
    )
    target = parser.add_mutually_exclusive_group()
    target.add_argument(
        "--target-db", type=float, help="every fixture's PSNR against the source precision at least this (dB)"
    )
    target.add_argument(
        "--target",
        choices=["parity"],
        default="parity",
        help="parity (default): each fixture inside the parity band, measured as `ditq sweep "
        "--parity-in-process` does (the model in process in bfloat16 against the source precision), "
        f"floor = the pair's mean PSNR minus {TOLERANCE_DB:g} dB",
    )
    parser.add_argument(
        "--margin-db",
        type=float,
        default=0.5,
        help="the search aims this far above each fixture's target (default 0.5)",
    )
    parser.add_argument(
        "--accept",
        choices=["inside", "undecided"],
        default="inside",
        help="under the parity target, what a fixture's verification must be: compare's decision inside "
        "(default), or also undecided (its mean PSNR at the floor, the interval over seeds not above it)",
    )
    parser.add_argument(
        "--budget",
        metavar="SIZE|P%",
        help="the component's weight bytes at most (12MiB, 1.5GB; each Linear counted as stored: a 4-bit one half "
        "a byte a weight plus its scales and any low-rank branch, an 8-bit one a byte plus its scales, a kept one "
        "its source dtype), or the share of the planned Linears' parameters kept in source precision at most (10%%)",
    )
    parser.add_argument("--seeds", default=DEFAULT_SEEDS, help=f"image seeds (default {DEFAULT_SEEDS})")
    parser.add_argument(
        "--max-seeds",
        type=int,
        default=MAX_SEEDS,
        help="under the parity target, a fixture the verification leaves undecided with its mean at or above its "
        f"floor gets more seeds, as `ditq sweep --seeds auto` adds them, up to this many (default {MAX_SEEDS}; "
        "the number of --seeds: none added)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        help="denoising steps (default: 8 on the bundled demo model, as its sweep; else 20)",
    )
    parser.add_argument("--cfg", type=float, default=1.0, help="true_cfg_scale (default 1.0)")
    parser.add_argument(
        "--proxy-seeds", type=int, default=2, help="the first N seeds feed the proxy (default 2)"
    )
    parser.add_argument(
        "--proxy-steps", type=int, default=2, help="the proxy compares the first N steps' output (default 2)"
    )
    parser.add_argument(
        "--max-rounds", type=int, default=3, help="search-and-verify rounds at most (default 3)"
    )
    parser.add_argument(
        "--max-layers",
        type=int,
        default=256,
        help="Linears measured one by one at most; past it, those of the most sensitive blocks, the rest "
        "estimated from their block (default 256)",
    )
    parser.add_argument(
        "--image-blocks",
        type=int,
        help="blocks whose final images are measured (with the whole component's) to calibrate the proxy, "
        "evenly spaced; the others get the proxy only (default: every block; a large model's plan needs few)",
    )
    parser.add_argument(
        "--component", default="transformer", help="the component to plan (default transformer)"
    )
    parser.add_argument(
        "--work",
        type=Path,
        help="keep the runs and checkpoints here (its reference, pair-bfloat16, verify-N and artifact-N are made "
        "afresh; default: a temporary folder, removed)",
    )
    add_load_arguments(parser, "where the pipeline runs", flags=("device", "dtype", "variant"))
    # ditq quantize's own flags: each candidate is measured rounded as the plan's artifact will be, and the plan
    # records it (``rounding``) for ditq quantize --plan; GPTQ's requests are the plan's fixtures
    add_rounding_arguments(parser, quantize=False)


def summary(plan: PlanFile, out: Path) -> list[str]:
    """What the command prints: the mix, the verification and the cost."""
    counts = Counter(plan.layers.values())
    mix = ", ".join(f"{n} {scheme}" for scheme, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    rounding = plan.rounding.method + (
        f", low rank {plan.rounding.low_rank}" if plan.rounding.low_rank else ""
    )
    lines = [f"{out}: {len(plan.layers)} Linears of {plan.component}: {mix}; {plan.quantized_fraction:.1%} of "
             f"their parameters quantized ({rounding})"]  # fmt: skip
    if plan.verification is not None:
        v = plan.verification
        per_fixture = ", ".join(
            f"{f} {db:.2f} (target {plan.target.per_fixture_db.get(f, plan.target.db):.2f}"
            + (f", {v.decisions[f]}" if f in v.decisions else "")
            + ")"
            for f, db in v.psnr_db.items()
        )
        state = "meets the target" if v.meets_target else "DOES NOT meet the target"
        added = "".join(f", {f} +{len(more)}" for f, more in v.seeds_added.items())
        lines.append(f"verified ({len(v.seeds)} seeds{added}, {v.rounds} rounds): {state}: {per_fixture} dB")
    if plan.calibration is not None:
        c = plan.calibration
        lines.append(
            f"proxy: rank correlation with the image's PSNR {c.spearman}, prediction error {c.residual_db} dB "
            f"(median over {c.points} unit x scheme x fixture points)"
        )
    if plan.cost is not None:
        lines.append(
            f"cost: {plan.cost.seconds:.0f} s, {plan.cost.forwards} {plan.component} forwards on {plan.cost.device}"
        )
    return lines


def run(args: argparse.Namespace) -> int:
    from ditq.plan.planner import PlanOptions, make_plan

    plan = make_plan(
        PlanOptions(
            model=resolve_model(args.model, args.variant),
            out=args.out,
            fixtures=args.fixtures,
            refs=args.refs,
            schemes=tuple(s.strip() for s in args.schemes.split(",") if s.strip()),
            target_db=args.target_db,
            margin_db=args.margin_db,
            budget=args.budget,
            seeds=args.seeds,
            proxy_seeds=args.proxy_seeds,
            proxy_steps=args.proxy_steps,
            steps=args.steps,
            cfg=args.cfg,
            component=args.component,
            load=load_options_from_args(args),
            work=args.work,
            max_rounds=args.max_rounds,
            max_layers=args.max_layers,
            image_blocks=args.image_blocks,
            accept=args.accept,
            max_seeds=args.max_seeds,
            command=("ditq", *sys.argv[1:]),
            calibrate=args.calibrate or "rtn",
            low_rank=args.low_rank,
            calibration_seeds=args.calibration_seeds or CALIBRATION_SEEDS,
            calibration_steps=args.calibration_steps or CALIBRATION_STEPS,
            calibration_memory=args.calibration_memory,
        ),
        say=lambda line: print(line, file=sys.stderr, flush=True),
    )
    for line in summary(plan, args.out):
        print(line)
    return 0 if plan.verification is not None and plan.verification.meets_target else 1
