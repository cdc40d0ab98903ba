"""`ditq compare`: PSNR / SSIM (/ LPIPS) of runs against a sealed baseline, with a parity band."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from ditq.errors import InputError
from ditq.judge.baseline import require_sealed
from ditq.judge.compare import TOLERANCE_DB, ParityBand, compare_run, format_compare, parity_from_pair
from ditq.runfiles import COMPARE_FILE, RUN_FILE, to_json, write_model

__all__ = ["add_arguments", "run"]


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
    results = [
        compare_run(path, args.baseline, baseline_seal=seal, parity=band, use_lpips=not args.no_lpips)
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
    inside = all(r.parity is None or r.parity.inside for r in results)
    return 0 if complete and inside else 1
