"""Command-line layers, one module per sub-command: argument parsing over the Python API, nothing more."""

from __future__ import annotations

import argparse

__all__ = ["add_variant_argument"]


def add_variant_argument(parser: argparse.ArgumentParser) -> None:
    """``--variant NAME``, read as ``ditq.runtime.loader.load_pipeline`` reads it (the commands that load a model)."""
    parser.add_argument(
        "--variant",
        metavar="NAME",
        help="read each component's NAME variant weights (e.g. fp16: *.fp16.safetensors) where it has them, as "
        "diffusers' from_pretrained(variant=...) does (default: the variant an artifact records, else the "
        "default files)",
    )
