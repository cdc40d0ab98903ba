"""`ditq baseline`: the sealed BF16 run of a model over the fixtures, in process or through an endpoint."""

from __future__ import annotations

import argparse

from ditq.checkpoint.hub import resolve_model
from ditq.commands import add_load_arguments, load_options_from_args
from ditq.commands.probe import add_api_key_argument, add_matrix_arguments
from ditq.probe.fixtures import parse_seeds

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        metavar="PATH",
        help="the unquantized diffusers model directory or hub id (org/name[@revision], through the hub cache)",
    )
    add_matrix_arguments(parser)
    parser.add_argument(
        "--endpoint", help="generate through this server (serving PATH) instead of in process"
    )
    add_api_key_argument(parser)  # with --endpoint
    add_load_arguments(
        parser,
        "in process: where to generate (in bfloat16)",
        flags=("device", "offload", "variant", "compile"),
    )


def run(args: argparse.Namespace) -> int:
    from ditq.judge.baseline import BaselineOptions, make_baseline
    from ditq.probe.records import is_success, latest_by_key, read_records
    from ditq.runfiles import RECORDS_FILE

    seeds = parse_seeds(args.seeds)  # before anything runs: a bad --seeds is one line
    summary = make_baseline(
        BaselineOptions(
            model=resolve_model(args.model, args.variant),
            fixtures=args.fixtures,
            refs=args.refs,
            out=args.out,
            seeds=seeds,
            only=args.only.split(",") if args.only else None,
            steps=args.steps,
            true_cfg_scale=args.cfg,
            endpoint=args.endpoint,
            load=load_options_from_args(args),
            timeout_s=args.timeout,
            concurrency=args.concurrency,
            retry_failed=args.retry_failed,
            retry_out_of_memory=args.retry_out_of_memory,
            server_pid=args.server_pid,
            memory_interval_s=args.memory_interval,
            progress=not args.no_progress,
            api_key=args.api_key,
        )
    )
    records = latest_by_key(read_records(args.out / RECORDS_FILE))
    failed = [key for key, record in records.items() if not is_success(record)]
    print(
        f"{args.out}: baseline of {len(records)} requests ({summary.completed} run now), "
        f"{len(failed)} failed; sealed in {args.out / 'SEAL.json'}"
    )
    for fixture_id, seed in failed:
        print(f"  failed: {fixture_id} s{seed}: {records[(fixture_id, seed)].error}")
    return 0 if not failed else 1
