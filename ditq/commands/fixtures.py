"""`ditq fixtures init`: a fixtures set (fixtures.json + refs/) from a folder of pictures and a prompts file."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    init = sub.add_parser(
        "init",
        help="write DIR/fixtures (fixtures.json and refs/) from DIR's pictures and DIR/prompts.txt",
        description="One request per line of the prompts file: 'ID: PROMPT' (text to image) or "
        "'ID [REF1 REF2]: PROMPT' (an edit; each REF is a picture of DIR by its name without the extension).",
    )
    init.add_argument("folder", type=Path, metavar="DIR", help="the reference pictures (PNG, JPEG, WebP)")
    init.add_argument("--prompts", type=Path, help="the prompts file (default: DIR/prompts.txt)")
    init.add_argument("--out", type=Path, help="the fixtures set to write (default: DIR/fixtures)")
    init.add_argument(
        "--size",
        default="1024x1024",
        metavar="WxH",
        help="every request's output size (default: %(default)s)",
    )
    init.add_argument("--force", action="store_true", help="replace OUT if it exists")


def run(args: argparse.Namespace) -> int:
    from ditq.probe.fixtures_init import init_fixtures
    from ditq.runtime.adapter import parse_size

    width, height = parse_size(args.size, "--size")
    out = args.out or args.folder / "fixtures"
    written = init_fixtures(
        args.folder, args.prompts or args.folder / "prompts.txt", out, width, height, args.force
    )
    print(f"wrote {written}; use: --fixtures {written} --refs {out / 'refs'}")
    return 0
