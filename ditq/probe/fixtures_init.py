"""A fixtures set made from a folder of reference pictures and a prompts file (``ditq fixtures init``).

``OUT/fixtures.json`` and ``OUT/refs/REF.png``, as ``ditq probe --fixtures OUT/fixtures.json --refs OUT/refs`` and
``ditq sweep`` read them. The prompts file holds one request per line: ``ID: PROMPT`` for text-to-image, ``ID [REF1 REF2 ...]: PROMPT`` for
an edit with those references, where each ``REF`` names a picture of the folder by its file name without the
extension (PNG, JPEG or WebP); blank lines and lines starting with ``#`` are skipped. Every request has the
same output size. The set is written to a temporary sibling, validated as ``ditq probe`` validates it, and renamed
into place: a refused input leaves nothing behind.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from PIL import Image

from ditq.errors import InputError
from ditq.fsutil import atomic_directory
from ditq.probe.fixtures import SIZE_MULTIPLE, load_fixtures

__all__ = ["IMAGE_SUFFIXES", "init_fixtures"]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
_LINE = re.compile(r"(?P<id>[A-Za-z0-9][A-Za-z0-9_.-]{0,63})\s*(\[(?P<refs>[^\]]*)\])?\s*:\s*(?P<prompt>.+)")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def _pictures(folder: Path) -> dict[str, Path]:
    if not folder.is_dir():
        raise InputError(f"{folder}: not a folder of reference pictures")
    found: dict[str, Path] = {}
    for path in sorted(folder.iterdir()):
        if path.suffix.lower() not in IMAGE_SUFFIXES or not path.is_file() or path.is_symlink():
            continue
        if not _NAME.fullmatch(path.stem):
            raise InputError(
                f"{path}: a reference is named by its file name: letters, digits, '.', '_' and '-'"
            )
        if path.stem in found:
            raise InputError(f"{path}: two pictures are named {path.stem!r}")
        found[path.stem] = path
    return found


def _requests(prompts: Path, pictures: dict[str, Path]) -> list[tuple[str, list[str], str]]:
    try:
        lines = prompts.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise InputError(f"{prompts}: cannot read the prompts file ({error})") from None
    requests: list[tuple[str, list[str], str]] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        match = _LINE.fullmatch(line.strip())
        if match is None:
            raise InputError(f"{prompts} line {number}: expected 'ID: PROMPT' or 'ID [REF ...]: PROMPT'")
        refs = (match.group("refs") or "").split()
        unknown = [r for r in refs if r not in pictures]
        if unknown:
            have = ", ".join(pictures) or "none"
            raise InputError(
                f"{prompts} line {number}: no picture {unknown[0]!r} in the folder (have: {have})"
            )
        if any(match.group("id") == seen for seen, _, _ in requests):
            raise InputError(f"{prompts} line {number}: fixture id {match.group('id')!r} given twice")
        requests.append((match.group("id"), refs, match.group("prompt").strip()))
    if not requests:
        raise InputError(f"{prompts}: no request in the prompts file")
    return requests


def init_fixtures(
    pictures_dir: Path, prompts: Path, out: Path, width: int, height: int, force: bool = False
) -> Path:
    """Write the fixtures set ``out`` (``fixtures.json``, ``refs/``) from ``pictures_dir`` and ``prompts``; returns
    ``out/fixtures.json``. An existing ``out`` is replaced only with ``force``."""
    out = Path(out)
    for name, value in (("--size width", width), ("--size height", height)):
        if value <= 0 or value % SIZE_MULTIPLE:
            raise InputError(f"{name}: {value} is not a positive multiple of {SIZE_MULTIPLE}")
    if out.exists() and not force:
        raise InputError(f"{out}: already exists (use --force to replace it)")
    pictures = _pictures(Path(pictures_dir))
    requests = _requests(Path(prompts), pictures)
    fixtures = {
        fixture_id: {
            "mode": "edit" if refs else "generate",
            "references": refs,
            "width": width,
            "height": height,
            "prompt": prompt,
            "negative_prompt": None,
        }
        for fixture_id, refs, prompt in requests
    }
    with atomic_directory(out, force=force) as tmp:
        (tmp / "refs").mkdir()
        for ref in sorted({ref for _, refs, _ in requests for ref in refs}):
            try:
                with Image.open(pictures[ref]) as image:
                    image.load()
                    mode = "RGBA" if image.mode in ("RGBA", "LA", "P") else "RGB"
                    image.convert(mode).save(tmp / "refs" / f"{ref}.png", format="PNG")
            except (OSError, ValueError) as error:
                raise InputError(f"{pictures[ref]}: not a readable picture ({error})") from None
        (tmp / "fixtures.json").write_text(json.dumps(fixtures, indent=2) + "\n")
        load_fixtures(tmp / "fixtures.json", tmp / "refs")  # as ditq probe will read it
    return out / "fixtures.json"
