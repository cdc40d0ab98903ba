"""A fixtures set made from a folder of reference pictures and a prompts file (``ditq fixtures init``).

``OUT/fixtures.json`` and ``OUT/refs/REF.png``, as ``ditq probe --fixtures OUT/fixtures.json --refs OUT/refs`` and
``ditq sweep`` read them. The prompts file holds one request per line: ``ID: PROMPT`` for text-to-image, ``ID [REF1 REF2 ...]: PROMPT`` for
an edit with those references, where each ``REF`` names a picture of the folder by its file name without the
extension (PNG, JPEG or WebP); blank lines and lines starting with ``#`` are skipped. Every request has the
same output size. The set is written to a temporary sibling, validated as ``ditq probe`` validates it, and renamed
into place: a refused input leaves nothing behind. ``OUT/ditq-fixtures.json`` marks the folder as a set ditq wrote:
``--force`` replaces only such a folder (``ditq.fsutil.check_output``), never one holding the pictures or the
prompts. Pictures are read by ``ditq.pictures`` (PNG, JPEG or WebP by signature, pixels bounded); the prompts
file is a regular file of at most ``MAX_PROMPTS_BYTES`` of UTF-8 text (a byte order mark is skipped).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ditq.errors import InputError
from ditq.fsutil import FIXTURES_SET, atomic_directory, check_output, read_bounded
from ditq.pictures import open_picture
from ditq.probe.fixtures import SIZE_MULTIPLE, load_fixtures

__all__ = ["IMAGE_SUFFIXES", "MAX_PROMPTS_BYTES", "init_fixtures"]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
MAX_PROMPTS_BYTES = 1 << 20  # a request per line: ten thousand long prompts fit
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
    data = read_bounded(prompts, MAX_PROMPTS_BYTES)
    try:
        lines = data.decode("utf-8-sig").splitlines()
    except UnicodeDecodeError as error:
        raise InputError(f"{prompts}: not UTF-8 text ({error.reason} at byte {error.start})") from None
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
    pictures = _pictures(Path(pictures_dir))
    inputs = [*pictures.values(), Path(prompts)]
    check_output(out, FIXTURES_SET, inputs)  # before anything is read: what --force may replace
    if out.exists() and not force:
        raise InputError(f"{out}: already exists (use --force to replace it)")
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
    with atomic_directory(out, FIXTURES_SET, inputs, force=force) as tmp:
        (tmp / "refs").mkdir()
        for ref in sorted({ref for _, refs, _ in requests for ref in refs}):
            with open_picture(pictures[ref]) as image:
                mode = "RGBA" if image.mode in ("RGBA", "LA", "P") else "RGB"
                image.convert(mode).save(tmp / "refs" / f"{ref}.png", format="PNG")
        (tmp / "fixtures.json").write_text(json.dumps(fixtures, indent=2) + "\n")
        marker = {"schema": "ditq-fixtures-set-v1", "written_by": "ditq fixtures init"}
        (tmp / FIXTURES_SET.markers[0]).write_text(json.dumps(marker) + "\n")
        load_fixtures(tmp / "fixtures.json", tmp / "refs")  # as ditq probe will read it
    return out / "fixtures.json"
