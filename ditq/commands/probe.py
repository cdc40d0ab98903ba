"""`ditq probe`: fixtures x seeds against one or more OpenAI-compatible image servers."""

from __future__ import annotations

import argparse
from pathlib import Path

from ditq.probe.fixtures import DEFAULT_SEEDS, parse_seeds

PROBE_API_KEY_ENV = "DITQ_PROBE_API_KEY"  # ditq.probe.runner.PROBE_API_KEY_ENV, without httpx for --help

__all__ = ["add_api_key_argument", "add_arguments", "add_matrix_arguments", "run"]


def add_api_key_argument(
    parser: argparse.ArgumentParser, what: str = "send 'Authorization: Bearer KEY' to the server(s)"
) -> None:
    """``--api-key``: what the harness sends as ``Authorization: Bearer KEY`` (default: $DITQ_PROBE_API_KEY)."""
    import os

    parser.add_argument(
        "--api-key",
        default=os.environ.get(PROBE_API_KEY_ENV),
        help=f"{what} (default: ${PROBE_API_KEY_ENV}; none); never written to the run's files",
    )


def add_matrix_arguments(parser: argparse.ArgumentParser) -> None:
    """What the probe and the baseline share: fixtures, seeds, sampler settings."""
    parser.add_argument(
        "--fixtures", type=Path, required=True, help="fixtures JSON (id -> mode, references, ...)"
    )
    parser.add_argument("--refs", type=Path, required=True, help="directory of reference images, REF.png")
    parser.add_argument("--out", type=Path, required=True, help="run directory (created; rerun to resume)")
    parser.add_argument(
        "--seeds", default=DEFAULT_SEEDS, help=f"e.g. 2301-2304 or 1,2,5 (default {DEFAULT_SEEDS})"
    )
    parser.add_argument("--steps", type=int, default=20, help="num_inference_steps (default 20)")
    parser.add_argument("--cfg", type=float, default=1.0, help="true_cfg_scale (default 1.0)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per request (default 1800)")
    parser.add_argument(
        "--concurrency", type=int, default=1, help="requests in flight per endpoint (default 1)"
    )
    parser.add_argument("--only", help="comma list of fixture ids to run (default: all)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--server-pid", type=int, help="server process id, to sample its own device memory")
    parser.add_argument("--memory-interval", type=float, default=1.0, help="seconds between memory samples")
    parser.add_argument("--retry-failed", action="store_true", help="redo requests whose record is a failure")
    parser.add_argument(
        "--retry-out-of-memory",
        action="store_true",
        help="redo only the requests that ran out of accelerator memory (say, on a server with more offload)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--endpoint",
        action="append",
        required=True,
        metavar="URL[,URL...]",
        help="server base URL (http://host:port); several (comma list or repeated) share one queue",
    )
    add_matrix_arguments(parser)
    add_api_key_argument(parser)
    parser.add_argument("--model", help="'model' field sent with each request (some servers require it)")
    parser.add_argument(
        "--server-wait",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="when a server stops answering, poll its /health with backoff this long before recording the "
        "rest of its requests as failed (default 60)",
    )


def run(args: argparse.Namespace) -> int:
    from ditq.probe.records import is_success, latest_by_key, read_records
    from ditq.probe.runner import ProbeOptions, run_probe
    from ditq.runfiles import RECORDS_FILE

    seeds = parse_seeds(args.seeds)  # before anything runs: a bad --seeds is one line
    endpoints = [url for value in args.endpoint for url in value.split(",") if url.strip()]
    summary = run_probe(
        ProbeOptions(
            endpoints=endpoints,
            fixtures=args.fixtures,
            refs=args.refs,
            seeds=seeds,
            out=args.out,
            steps=args.steps,
            true_cfg_scale=args.cfg,
            concurrency=args.concurrency,
            retry_failed=args.retry_failed,
            retry_out_of_memory=args.retry_out_of_memory,
            timeout_s=args.timeout,
            server_wait_s=args.server_wait,
            model=args.model,
            only=args.only.split(",") if args.only else None,
            memory_interval_s=args.memory_interval,
            server_pid=args.server_pid,
            progress=not args.no_progress,
            api_key=args.api_key,
        )
    )
    records = latest_by_key(read_records(args.out / RECORDS_FILE))
    failed = [key for key, record in records.items() if not is_success(record)]
    peak = "unavailable" if summary.peak_memory_mib is None else f"{summary.peak_memory_mib:.0f} MiB"
    print(
        f"{args.out}: {summary.completed} run now, {summary.skipped} already done, "
        f"{len(records) - len(failed)}/{len(records)} with an image; memory {summary.memory.source}, peak {peak}"
    )
    for fixture_id, seed in failed:
        print(f"  failed: {fixture_id} s{seed}: {records[(fixture_id, seed)].error}")
    return 0 if not failed else 1
