"""`ditq gate`: structure gate over runs (ditq runs or the seed probe's record format). A run that is not complete
(RUN.json not ``complete``, or a planned request without a record) is refused, as is such a baseline."""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

from ditq.judge.baseline import require_sealed
from ditq.judge.gate import build_envelopes, format_gate, gate_run, load_rules
from ditq.probe.records import require_complete
from ditq.runfiles import GATE_FILE, RUN_FILE, to_json, write_model

__all__ = ["add_arguments", "run"]

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", type=Path, metavar="RUN", help="run directories to judge")
    parser.add_argument("--baseline", type=Path, help="sealed baseline run: adds the per-fixture envelope")
    parser.add_argument("--rules", type=Path, help="rules JSON (default: the rules shipped with ditq)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument(
        "--allow-unsealed", action="store_true", help="accept an unsealed or altered baseline"
    )


def run(args: argparse.Namespace) -> int:
    rules = load_rules(args.rules)
    envelopes, baseline_note = None, None
    if args.baseline is not None:
        seal = require_sealed(args.baseline, args.allow_unsealed)
        require_complete(args.baseline)
        envelopes, baseline_note = build_envelopes(args.baseline, rules), f"{args.baseline} ({seal})"
    results = [gate_run(path, rules, envelopes, baseline_note, args.baseline) for path in args.runs]
    for path, result in zip(args.runs, results, strict=True):
        if (path / RUN_FILE).is_file() and os.access(path, os.W_OK):
            write_model(path / GATE_FILE, result.to_file())
    if args.json:
        print(json.dumps([to_json(r.to_file()) for r in results], indent=1))
    else:
        print(format_gate(results))
    return 0 if all(r.passed for r in results) else 1
