"""`ditq serve [PATH]`: serve an artifact or a plain diffusers model over an OpenAI-compatible images API."""

from __future__ import annotations

import argparse
from pathlib import Path

from ditq.serve import ServeConfig, serve

__all__ = ["add_arguments", "run"]

_DEFAULTS = ServeConfig()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "path", nargs="?", type=Path, help="artifact or diffusers directory (default: the demo model)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8091, help="port to listen on (default: %(default)s)")
    parser.add_argument("--served-model-name", help="the model id clients send (default: the directory name)")
    parser.add_argument(
        "--device", default="cpu", help="torch device to generate on, e.g. cuda:0 (default: cpu)"
    )
    parser.add_argument(
        "--dtype",
        choices=("bfloat16", "float16", "float32"),
        default="bfloat16",
        help="compute dtype of the unquantized parts and the activations (default: %(default)s)",
    )
    parser.add_argument(
        "--offload",
        choices=("none", "model", "block"),
        default="none",
        help="keep weights in host memory and move them per model or per block",
    )
    parser.add_argument(
        "--max-queue",
        type=int,
        default=_DEFAULTS.max_queue,
        help="requests that may wait behind the running one; more get 429 (default: %(default)s)",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=_DEFAULTS.request_timeout_s,
        metavar="S",
        help="seconds from arrival to answer, queue included; then 504 (default: %(default)s)",
    )
    parser.add_argument(
        "--max-memory",
        metavar="SIZE",
        help="cap the accelerator memory this process may use, e.g. 24GiB (CUDA only)",
    )
    parser.add_argument(
        "--max-pixels",
        type=int,
        default=_DEFAULTS.max_pixels,
        help="largest width*height of an output image (default: %(default)s)",
    )
    parser.add_argument(
        "--on-collapse",
        choices=("error", "warn"),
        default=_DEFAULTS.on_collapse,
        help="a collapsed image: fail with 500 non_finite_output, or return it with a warning",
    )
    parser.add_argument("--skip-doctor", action="store_true", help="do not run the kernel doctor at start-up")


def run(args: argparse.Namespace) -> int:
    name = args.served_model_name or (args.path.resolve().name if args.path else "ditq-demo")
    config = ServeConfig(
        served_model_name=name,
        max_queue=args.max_queue,
        request_timeout_s=args.request_timeout,
        max_pixels=args.max_pixels,
        on_collapse=args.on_collapse,
    )
    serve(
        args.path,
        config,
        host=args.host,
        port=args.port,
        device=args.device,
        offload=args.offload,
        dtype=args.dtype,
        max_memory=args.max_memory,
        skip_doctor=args.skip_doctor,
    )
    return 0
