"""`ditq report RUN... --baseline B --out DIR`: verdicts, serving profiles and the evidence, as files."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from ditq.report.verdict import STANDARDS, VerdictRules

if TYPE_CHECKING:
    from ditq.report.schema import VerdictDocument

OBJECTIVES = ("fit", "speed", "memory")  # ditq.report.schema.OBJECTIVES' keys, without pydantic for --help

__all__ = ["add_arguments", "add_objective_argument", "print_summary", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "runs", nargs="+", type=Path, metavar="RUN", help="run or sweep candidate directories"
    )
    parser.add_argument("--baseline", required=True, type=Path, help="the sealed BF16 baseline run directory")
    parser.add_argument(
        "--allow-unsealed",
        action="store_true",
        help="accept an unsealed or altered baseline, as gate and compare do (a warning says so)",
    )
    parser.add_argument("--out", required=True, type=Path, help="report directory (replaced as a whole)")
    parser.add_argument(
        "--baseline-name", default="BF16", help="what to call the baseline (default: %(default)s)"
    )
    parser.add_argument(
        "--baseline-attempts",
        type=Path,
        default=None,
        metavar="FILE",
        help="the baseline's offload attempts (a sweep's logs/baseline-attempts.json)",
    )
    parser.add_argument(
        "--note", default=None, help="a sentence for the top of the report (e.g. that the weights are random)"
    )
    parser.add_argument(
        "--parity-db",
        type=float,
        default=None,
        help="PSNR of a BF16 reference pair, when compare.json states no parity band",
    )
    parser.add_argument(
        "--parity-margin-db",
        type=float,
        default=VerdictRules.parity_margin_db,
        help="band floor = pair - margin",
    )
    add_objective_argument(parser)
    parser.add_argument(
        "--slower-tolerance",
        type=float,
        default=VerdictRules.slower_tolerance,
        help="fraction by which a candidate may be slower than BF16 before it counts as slower",
    )


def add_objective_argument(parser: argparse.ArgumentParser) -> None:
    """--objective and --standard: what the headline verdict answers, and the fidelity standard of fit to serve."""
    parser.add_argument(
        "--objective",
        choices=OBJECTIVES,
        default=VerdictRules.objective,
        help="what the headline verdict answers: fit (to serve), speed (faster), memory (smaller); all three are "
        "answered either way (default: %(default)s)",
    )
    parser.add_argument(
        "--standard",
        choices=STANDARDS,
        default=VerdictRules.standard,
        help="the fidelity standard fit to serve uses: lossless (each fixture's PSNR and SSIM intervals above "
        "40 dB and 0.98) or parity (as close to the baseline as a second acceptable run); both are answered "
        "either way (default: %(default)s)",
    )


def print_summary(document: VerdictDocument) -> None:
    """Each candidate's line, then which one to serve and why not the others."""
    for entry in document.candidates:
        print(entry.summary(document.objective, document.standard))
    print(document.recommendation.why)
    for name, why in document.recommendation.others.items():
        print(f"  not {name}: {why}")


def run(args: argparse.Namespace) -> int:
    from ditq.judge.baseline import require_sealed
    from ditq.report import build_report

    # as gate and compare: a baseline whose records or images changed since it was sealed is refused (its timings
    # and pictures are what every candidate is judged against)
    require_sealed(args.baseline, args.allow_unsealed)
    rules = VerdictRules(
        slower_tolerance=args.slower_tolerance,
        parity_margin_db=args.parity_margin_db,
        parity_reference_db=args.parity_db,
        objective=args.objective,
        standard=args.standard,
    )
    result = build_report(
        args.runs,
        args.baseline,
        args.out,
        rules,
        baseline_name=args.baseline_name,
        baseline_attempts=args.baseline_attempts,
        note=args.note,
    )
    print_summary(result.data.document)
    print(result.html)
    return 0
