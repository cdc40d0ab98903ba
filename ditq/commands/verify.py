"""`ditq verify`: a thin layer over ``ditq.quantization.verifier.verify``; exit 0 only when every check holds."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ditq.fsutil import atomic_write_json
from ditq.quantization.defaults import REL_L2_BOUNDS

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("artifact", type=Path, metavar="ARTIFACT", help="directory written by ditq quantize")
    bounds = ", ".join(f"{k} {v}" for k, v in REL_L2_BOUNDS.items())
    parser.add_argument(
        "--source",
        type=Path,
        metavar="SRC",
        help=f"the source model: rel-L2 per tensor must stay within ({bounds}), kept tensors identical, "
        "every other file the source's (configs but for quantization_config, links into SRC)",
    )
    parser.add_argument(
        "--json", type=Path, metavar="FILE", help="also write the full report as JSON ('-' for stdout)"
    )


def run(args: argparse.Namespace) -> int:
    from ditq.quantization.verifier import verify

    report = verify(args.artifact, args.source)
    if args.json is not None and str(args.json) == "-":
        print(json.dumps(report.to_json(), indent=1))
    else:
        print(report.table())
        if args.json is not None:
            atomic_write_json(args.json, report.to_json())
    return 0 if report.ok else 1
