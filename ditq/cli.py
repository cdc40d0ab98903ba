"""The `ditq` command: one sub-command per step of the chain.

Each step lives in its own module, which exposes ``add_arguments(parser)``
and ``run(args) -> int``; this file only wires them up and turns ditq's
errors into one-line messages and exit codes (0 ok, 1 failure, 2 usage or
input error).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from ditq.errors import EXIT_FAILURE, EXIT_USAGE, DitqError, error_line

__all__ = ["COMMANDS", "main"]

# name -> (module, one-line help). The module owns its arguments and its run().
COMMANDS: dict[str, tuple[str, str]] = {
    "quantize": (
        "ditq.commands.quantize",
        "quantize a diffusers model directory into a compressed-tensors artifact",
    ),
    "plan": (
        "ditq.commands.plan",
        "measure each Linear's sensitivity and plan a scheme per layer (mixed precision), verified end to end",
    ),
    "verify": ("ditq.commands.verify", "check an artifact's digests and decode every quantized tensor twice"),
    "generate": ("ditq.commands.generate", "one image from an artifact, a diffusers directory or the demo"),
    "baseline": ("ditq.commands.baseline", "run the unquantized model over the fixtures and seal the result"),
    "fixtures": (
        "ditq.commands.fixtures",
        "make a fixtures set from a folder of pictures and a prompts file",
    ),
    "probe": ("ditq.commands.probe", "send fixtures x seeds to image servers, recording every request"),
    "gate": ("ditq.commands.gate", "judge a run's images: collapse signatures and the baseline envelope"),
    "compare": (
        "ditq.commands.compare",
        "PSNR / SSIM of a run against a sealed baseline, with a parity band",
    ),
    "serve": (
        "ditq.commands.serve",
        "serve an artifact or a plain model over an OpenAI-compatible images API",
    ),
    "report": ("ditq.commands.report", "judge runs against the baseline: verdicts, profiles, charts"),
    "doctor": ("ditq.commands.doctor", "check every kernel path on this device against a float32 reference"),
    "sweep": (
        "ditq.commands.sweep",
        "the main job: baseline, then every scheme through the chain, one report",
    ),
    "demo": ("ditq.commands.demo", "the sweep on the bundled demo model, on the CPU, in minutes"),
}


def _logging_options(default: object) -> argparse.ArgumentParser:
    """-v / -q, taken before the command and after it alike (after it, only what is given overrides)."""
    options = argparse.ArgumentParser(add_help=False)
    group = options.add_mutually_exclusive_group()
    group.add_argument("-v", "--verbose", action="store_true", default=default, help="log debug messages")
    group.add_argument(
        "-q", "--quiet", action="store_true", default=default, help="log warnings and errors only"
    )
    return options


def _build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    """Every command is listed; only the one being run is imported (importing torch for `gate` would be waste)."""
    from ditq import __version__

    parser = argparse.ArgumentParser(
        prog="ditq",
        description="8-bit diffusion transformers, with evidence.",
        parents=[_logging_options(False)],
    )
    parser.add_argument("--version", action="version", version=f"ditq {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = next((arg for arg in argv if not arg.startswith("-")), None)
    after = _logging_options(argparse.SUPPRESS)
    for name, (module_name, help_text) in COMMANDS.items():
        command_parser = sub.add_parser(name, help=help_text, description=help_text, parents=[after])
        if name == chosen:
            module = importlib.import_module(module_name)
            module.add_arguments(command_parser)
            command_parser.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _build_parser(argv).parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING if args.quiet else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return int(args._run(args))
    except DitqError as error:
        print(f"ditq {args.command}: error: {error}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        print(f"ditq {args.command}: interrupted", file=sys.stderr)
        return EXIT_FAILURE
    except FileNotFoundError as error:
        print(f"ditq {args.command}: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as error:  # what the system refused: a full disk, a quota, a read-only folder, permissions
        # the file where the system names it, else what the command was writing; an OSError that is no system
        # error (no errno: a library's "no file named scheduler_config.json in ...") names its own file
        target = error.filename or (getattr(args, "out", None) if error.errno is not None else None)
        where = f"{target}: " if target else ""
        print(f"ditq {args.command}: error: {where}{error.strerror or error_line(error)}", file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":
    raise SystemExit(main())
