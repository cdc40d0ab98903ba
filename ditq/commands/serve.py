"""`ditq serve [PATH]`: serve an artifact or a plain diffusers model over an OpenAI-compatible images API."""

from __future__ import annotations

import argparse
import os

from ditq.checkpoint.hub import hub_origin, resolve_model
from ditq.commands import add_load_arguments, load_options_from_args
from ditq.errors import InputError
from ditq.serve.config import ServeConfig, api_key_problem
from ditq.serve.connections import ConnectionLimits

__all__ = ["API_KEY_ENV", "add_arguments", "api_key", "run"]

API_KEY_ENV = "DITQ_API_KEY"

_DEFAULTS = ServeConfig()
_LIMITS = ConnectionLimits()
# (flag, type, default, metavar, help) of the connection options
_CONNECTION_OPTIONS: tuple[tuple[str, type, float, str, str], ...] = (
    (
        "--max-connections",
        int,
        _LIMITS.max_connections,
        "N",
        "open connections held at most; past it an idle one is closed, or the new one refused",
    ),
    (
        "--header-timeout",
        float,
        _LIMITS.header_timeout_s,
        "S",
        "seconds for a request line and headers to arrive",
    ),
    (
        "--body-timeout",
        float,
        _DEFAULTS.body_timeout_s,
        "S",
        "seconds from the headers to the end of the body (408)",
    ),
    (
        "--idle-timeout",
        int,
        _LIMITS.idle_timeout_s,
        "S",
        "seconds a keep-alive connection may idle between requests",
    ),
    (
        "--drain-timeout",
        float,
        30.0,
        "S",
        "on SIGTERM, seconds to finish queued and running requests before stopping them",
    ),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "path",
        nargs="?",
        help="artifact or diffusers directory or hub id (org/name[@revision], through the hub cache) (default: the demo model)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8091, help="port to listen on (default: %(default)s)")
    parser.add_argument(
        "--served-model-name",
        help="the model id clients send (default: the hub id of a hub snapshot, else the directory name)",
    )
    add_load_arguments(parser, helps={"skip_doctor": "do not run the kernel doctor at start-up"})
    parser.add_argument(
        "--parallel",
        metavar="cp=N|tp=N",
        help="serve over N devices, one process each, through diffusers' parallelism: cp (context parallel: each "
        "rank takes a share of the tokens) or tp (tensor parallel: a share of each weight; CUDA, source precision)",
    )
    parser.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME=PATH[:SCALE]",
        help="load a LoRA adapter at start (repeatable): PATH a .safetensors file or a folder holding one (diffusers' "
        "or peft's format), SCALE its weight (default 1); a request picks adapters by NAME in its 'lora' field, "
        "and one without it gets every adapter at its SCALE",
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
        "--max-pixels",
        type=int,
        default=_DEFAULTS.max_pixels,
        help="largest width*height of an output image (default: %(default)s)",
    )
    parser.add_argument(
        "--max-references",
        type=int,
        metavar="N",
        help="the most reference images a request may carry; the cost model is calibrated up to it, no further "
        "(default: as many as the pipeline takes)",
    )
    parser.add_argument(
        "--on-collapse",
        choices=("error", "warn"),
        default=_DEFAULTS.on_collapse,
        help="a collapsed image: fail with 500 non_finite_output, or return it with a warning",
    )
    parser.add_argument(
        "--max-image-pixels",
        type=int,
        default=_DEFAULTS.max_image_pixels,
        help="largest width*height of one uploaded image, read from its header (default: %(default)s)",
    )
    parser.add_argument(
        "--max-upload-pixels",
        type=int,
        default=_DEFAULTS.max_upload_pixels,
        help="largest width*height of a request's uploaded images together (default: %(default)s)",
    )
    security = parser.add_argument_group("access")
    security.add_argument(
        "--api-key",
        metavar="KEY",
        help=f"require 'Authorization: Bearer KEY' on every path but /health (default: ${API_KEY_ENV}; none)",
    )
    security.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a Host name clients may use (repeatable; '*': any). Default: the loopback names for a loopback "
        "--host, any name otherwise",
    )
    security.add_argument("--docs", action="store_true", help="serve FastAPI's /docs and /openapi.json")
    connections = parser.add_argument_group("connections")
    for flag, kind, default, metavar, help_text in _CONNECTION_OPTIONS:
        connections.add_argument(
            flag, type=kind, default=default, metavar=metavar, help=f"{help_text} (default: %(default)s)"
        )


def api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else $DITQ_API_KEY; one that no request could match is a usage error naming where it came
    from."""
    given, source = (
        (args.api_key, "--api-key")
        if args.api_key is not None
        else (os.environ.get(API_KEY_ENV), API_KEY_ENV)
    )
    if given is not None and (problem := api_key_problem(given)) is not None:
        raise InputError(f"{source}: the API key {problem}")
    return given


def run(args: argparse.Namespace) -> int:
    from ditq.runtime.lora_adapters import parse_lora_specs
    from ditq.runtime.parallel import parse_parallel
    from ditq.serve import serve
    from ditq.serve.access import default_allowed_hosts

    parallel = None if args.parallel is None else parse_parallel(args.parallel)
    lora = parse_lora_specs(args.lora)
    model = None if args.path is None else resolve_model(args.path, args.variant)
    origin = None if model is None else hub_origin(model)
    name = args.served_model_name or (
        "ditq-demo" if model is None else origin[0] if origin is not None else model.resolve().name
    )
    config = ServeConfig(
        served_model_name=name,
        max_queue=args.max_queue,
        request_timeout_s=args.request_timeout,
        body_timeout_s=args.body_timeout,
        max_pixels=args.max_pixels,
        max_references=args.max_references,
        max_image_pixels=args.max_image_pixels,
        max_upload_pixels=args.max_upload_pixels,
        on_collapse=args.on_collapse,
        api_key=api_key(args),
        allowed_hosts=default_allowed_hosts(args.host, args.allowed_host),
        docs=args.docs,
    )
    try:
        limits = ConnectionLimits(args.max_connections, args.header_timeout, args.idle_timeout)
    except ValueError as error:
        raise InputError(f"--max-connections, --header-timeout, --idle-timeout: {error}") from None
    if args.drain_timeout < 0:
        raise InputError(f"--drain-timeout: must not be negative, got {args.drain_timeout}")
    serve(
        model,
        config,
        load_options_from_args(args),
        host=args.host,
        port=args.port,
        limits=limits,
        drain_timeout_s=args.drain_timeout,
        parallel=parallel,
        lora=lora,
    )
    return 0
