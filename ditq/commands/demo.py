"""`ditq demo [--out DIR]`: the sweep on the bundled demo model and fixtures, on the CPU, in minutes."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ditq.commands import load_options_from_args
from ditq.commands.sweep import add_sweep_arguments, print_verdicts, stop_on_sigterm
from ditq.demo.settings import DEMO, demo_fixtures
from ditq.devices import resolve_device

if TYPE_CHECKING:
    from ditq.sweep import SweepOptions

__all__ = ["add_arguments", "demo_options", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out", type=Path, default=Path("demo-out"), help="sweep directory (default: demo-out)"
    )
    add_sweep_arguments(parser, device="cpu")
    parser.add_argument(
        "--no-plan",
        action="store_true",
        help="judge the uniform schemes only, not the demo model's shipped plan (ditq/demo/PLAN.json)",
    )
    parser.epilog = (
        f"The demo's own defaults: --seeds {DEMO.seeds} --steps {DEMO.steps} --device cpu "
        f"--dtype {DEMO.dtype} --parity-in-process, schemes {','.join(DEMO.schemes)}, and the shipped plan "
        "as one more candidate (plan), quantized from it and verified like the others."
    )


def demo_options(args: argparse.Namespace) -> SweepOptions:
    """The sweep ``ditq demo`` runs: the bundled model, fixtures and plan with the demo's defaults."""
    from ditq import demo
    from ditq.sweep import SweepOptions, check_seeds

    check_seeds(args.seeds or DEMO.seeds, args.max_seeds)  # before the fixtures are written
    return SweepOptions(
        model=demo.default_model_dir(),
        schemes=DEMO.schemes,
        fixtures=demo_fixtures(),
        refs=demo.references_dir(),
        out=args.out,
        seeds=args.seeds or DEMO.seeds,
        max_seeds=args.max_seeds,
        steps=args.steps if args.steps is not None else DEMO.steps,
        cfg=args.cfg,
        load=load_options_from_args(
            args, device=str(resolve_device(args.device)), dtype=args.dtype or DEMO.dtype, offload="none"
        ),
        offload=args.offload,
        parity_db=args.parity_db,
        parity_pair=tuple(args.parity_pair) if args.parity_pair else None,
        parity_in_process=args.parity_in_process
        or (DEMO.parity_in_process and args.parity_db is None and not args.parity_pair),
        objective=args.objective,
        standard=args.standard,
        health_timeout_s=args.health_timeout,
        progress=not args.no_progress,
        plan=args.plan or (None if args.no_plan else demo.plan_path()),
    )


def run(args: argparse.Namespace) -> int:
    from ditq.sweep import SCHEME_STAGES, run_sweep

    started = time.monotonic()
    options = demo_options(args)
    stop_on_sigterm()
    result = run_sweep(options)
    print_verdicts(result)
    print(
        f"demo: {len(SCHEME_STAGES) * len(options.candidates) + 2 + options.parity_in_process} stages (the "
        f"baseline, {'the reference pair, ' if options.parity_in_process else ''}{len(SCHEME_STAGES)} per candidate, "
        f"the report) in {time.monotonic() - started:.0f} s"
    )
    return 0
