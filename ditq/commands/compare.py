"""`ditq compare`: PSNR / SSIM (/ LPIPS) of runs against a sealed baseline, with a parity band and the visually
lossless standard."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from ditq.errors import InputError
from ditq.judge.baseline import require_sealed
from ditq.judge.compare import (
    LOSSLESS_PSNR_DB,
    LOSSLESS_SSIM,
    TOLERANCE_DB,
    LosslessStandard,
    ParityBand,
    compare_run,
    format_compare,
    parity_from_pair,
)
from ditq.runfiles import COMPARE_FILE, RUN_FILE, to_json, write_model

__all__ = ["add_arguments", "add_lossless_arguments", "lossless_standard", "run"]


def add_lossless_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--lossless-psnr-db",
        type=float,
        default=LOSSLESS_PSNR_DB,
        metavar="DB",
        help=f"visually lossless: the lowest mean PSNR per fixture (default {LOSSLESS_PSNR_DB:g})",
    )
    parser.add_argument(
        "--lossless-ssim",
        type=float,
        default=LOSSLESS_SSIM,
        metavar="S",
        help=f"visually lossless: the lowest mean SSIM per fixture (default {LOSSLESS_SSIM:g})",
    )


def lossless_standard(args: argparse.Namespace) -> LosslessStandard:
    """The thresholds given, checked: a PSNR in (0, 100] dB and an SSIM in (0, 1]."""
    if not 0 < args.lossless_psnr_db <= 100:
        raise InputError(
            f"--lossless-psnr-db {args.lossless_psnr_db:g}: give a PSNR in dB, above 0 and at most 100"
        )
    if not 0 < args.lossless_ssim <= 1:
        raise InputError(f"--lossless-ssim {args.lossless_ssim:g}: give an SSIM above 0 and at most 1")
    return LosslessStandard(args.lossless_psnr_db, args.lossless_ssim)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", type=Path, metavar="RUN", help="candidate run directories")
    parser.add_argument("--baseline", type=Path, required=True, help="sealed baseline run")
    parser.add_argument(
        "--parity-pair",
        nargs=2,
        type=Path,
        metavar=("RUN_A", "RUN_B"),
        help="two acceptable reference runs (e.g. two BF16 implementations) that define the band",
    )
    parser.add_argument("--parity-db", type=float, help="the parity band's PSNR, stated in dB")
    parser.add_argument(
        "--tolerance-db",
        type=float,
        default=TOLERANCE_DB,
        help="how far below the band still counts (dB)",
    )
    add_lossless_arguments(parser)
    parser.add_argument(
        "--standard",
        choices=("parity", "lossless"),
        default="parity",
        help="what the exit code answers: every fixture inside the parity band (default; with no band, every image "
        "compared), or visually lossless",
    )
    parser.add_argument("--no-lpips", action="store_true", help="do not try LPIPS")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument(
        "--allow-unsealed", action="store_true", help="accept an unsealed or altered baseline"
    )


def run(args: argparse.Namespace) -> int:
    if args.parity_pair and args.parity_db is not None:
        raise InputError("--parity-pair and --parity-db: give one of them")
    seal = require_sealed(args.baseline, args.allow_unsealed)
    band = None
    if args.parity_pair:
        band = parity_from_pair(args.parity_pair[0], args.parity_pair[1], args.tolerance_db)
    elif args.parity_db is not None:
        band = ParityBand("stated", args.parity_db, {}, args.tolerance_db)
    lossless = lossless_standard(args)
    results = [
        compare_run(
            path,
            args.baseline,
            baseline_seal=seal,
            parity=band,
            use_lpips=not args.no_lpips,
            lossless=lossless,
        )
        for path in args.runs
    ]
    for path, result in zip(args.runs, results, strict=True):
        if (path / RUN_FILE).is_file() and os.access(path, os.W_OK):
            write_model(path / COMPARE_FILE, result)
    if args.json:
        print(json.dumps([to_json(r) for r in results], indent=1))
    else:
        print(format_compare(results))
    complete = all(r.overall.ok == r.overall.n and r.overall.n > 0 for r in results)
    if args.standard == "lossless":
        inside = all(r.lossless is not None and r.lossless.inside for r in results)
    else:
        inside = all(r.parity is None or r.parity.inside for r in results)
    return 0 if complete and inside else 1
