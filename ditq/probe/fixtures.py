"""Fixtures: what to ask the server for, validated once, on load.

A fixtures file maps an id to ``{mode, references, width, height, prompt,
negative_prompt[, derived_from]}``; ``mode`` is ``generate`` (no references) or
``edit`` (one or more). Reference ``R`` is the file ``REFS_DIR/R.png``.

Fixture ids and reference ids are plain names (``plain_name``): they become file names (``images/ID.sSEED.png``
under the run directory, ``REFS_DIR/R.png``), so one that could name another folder is refused, and nothing is
read outside ``REFS_DIR`` or written outside the run directory.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ditq.errors import InputError
from ditq.jsonfile import read_json
from ditq.runfiles import set_digest

if TYPE_CHECKING:  # the request is built on demand: reading fixtures needs no torch
    from ditq.runtime.adapter import GenerationRequest

__all__ = [
    "DEFAULT_SEEDS",
    "MODES",
    "SIZE_MULTIPLE",
    "Fixture",
    "fixture_digest",
    "fixture_digests",
    "load_fixtures",
    "parse_seeds",
    "plain_name",
    "seeds_text",
]

MODES = ("generate", "edit")
SIZE_MULTIPLE = 16
_REQUIRED = ("mode", "references", "width", "height", "prompt")
_OPTIONAL = ("negative_prompt", "derived_from")
_NAME_MAX = 128


def plain_name(value: object, what: str) -> str:
    """``value`` if it is a plain name: a non-empty string of at most 128 characters with no path separator, no
    control character and no leading dot (so neither ``..`` nor a hidden file), else an InputError naming ``what``."""
    if not isinstance(value, str) or not value:
        raise InputError(f"{what}: must be a non-empty string, got {value!r}")
    if (
        len(value) > _NAME_MAX
        or value.startswith(".")
        or any(c in "/\\" or ord(c) < 32 or ord(c) == 127 for c in value)
    ):
        shown = value if len(value) <= 40 else value[:40] + "..."
        raise InputError(
            f"{what}: {shown!r} is not a plain name (at most {_NAME_MAX} characters, no '/' or '\\', no "
            "control character, not starting with '.')"
        )
    return value


@dataclass(frozen=True)
class Fixture:
    id: str
    mode: str
    references: tuple[str, ...]
    width: int
    height: int
    prompt: str
    negative_prompt: str | None
    reference_paths: tuple[Path, ...]
    derived_from: str | None = None

    @property
    def size(self) -> str:
        return f"{self.width}x{self.height}"

    def request(self, seed: int, steps: int, true_cfg_scale: float | None = None) -> GenerationRequest:
        """This fixture as one in-process request (prompt, references read from disk, size) at ``seed``."""
        from ditq.pictures import open_picture
        from ditq.runtime.adapter import GenerationRequest

        return GenerationRequest(
            prompt=self.prompt,
            negative_prompt=self.negative_prompt,
            images=[open_picture(path) for path in self.reference_paths],
            width=self.width,
            height=self.height,
            num_inference_steps=steps,
            true_cfg_scale=true_cfg_scale,
            seed=seed,
        )


def _fixture(source: Path, fixture_id: str, raw: Any, refs_dir: Path) -> Fixture:
    where = f"{source}: fixture {fixture_id!r}"
    plain_name(fixture_id, f"{source}: fixture id")
    if not isinstance(raw, dict):
        raise InputError(f"{where}: expected an object, got {type(raw).__name__}")
    for field in _REQUIRED:
        if field not in raw:
            raise InputError(f"{where}: missing field {field!r}")
    unknown = sorted(set(raw) - set(_REQUIRED) - set(_OPTIONAL))
    if unknown:
        raise InputError(f"{where}: unknown field {unknown[0]!r} (known: {', '.join(_REQUIRED + _OPTIONAL)})")
    mode = raw["mode"]
    if mode not in MODES:
        raise InputError(f"{where}: field 'mode' is {mode!r}; expected one of {', '.join(MODES)}")
    references = raw["references"]
    if not isinstance(references, list) or not all(isinstance(r, str) and r for r in references):
        raise InputError(f"{where}: field 'references' must be a list of reference ids")
    if mode == "edit" and not references:
        raise InputError(f"{where}: field 'references' is empty; mode 'edit' needs at least one")
    if mode == "generate" and references:
        raise InputError(f"{where}: field 'references' must be empty for mode 'generate'")
    for ref in references:
        plain_name(ref, f"{where}: field 'references'")
    for field in ("width", "height"):
        value = raw[field]
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise InputError(f"{where}: field {field!r} must be a positive integer, got {value!r}")
        if value % SIZE_MULTIPLE:
            raise InputError(f"{where}: field {field!r} is {value}, not a multiple of {SIZE_MULTIPLE}")
    if not isinstance(raw["prompt"], str) or not raw["prompt"].strip():
        raise InputError(f"{where}: field 'prompt' must be a non-empty string")
    negative = raw.get("negative_prompt")
    if negative is not None and not isinstance(negative, str):
        raise InputError(f"{where}: field 'negative_prompt' must be a string or null")
    paths = tuple(refs_dir / f"{ref}.png" for ref in references)
    for ref, path in zip(references, paths, strict=True):
        if not path.is_file():
            raise InputError(f"{where}: field 'references': reference file {path} for {ref!r} not found")
    return Fixture(
        id=fixture_id,
        mode=mode,
        references=tuple(references),
        width=raw["width"],
        height=raw["height"],
        prompt=raw["prompt"],
        negative_prompt=negative,
        reference_paths=paths,
        derived_from=raw.get("derived_from"),
    )


def load_fixtures(path: Path, refs_dir: Path) -> dict[str, Fixture]:
    """Read and validate a fixtures file; every error names the fixture and the field."""
    path, refs_dir = Path(path), Path(refs_dir)
    raw = read_json(path)
    if not isinstance(raw, dict) or not raw:
        raise InputError(f"{path}: expected a non-empty object mapping fixture id to fixture")
    return {fixture_id: _fixture(path, fixture_id, value, refs_dir) for fixture_id, value in raw.items()}


def fixture_digests(fixtures: dict[str, Fixture]) -> dict[str, str]:
    """Per fixture: sha256 over its content and the bytes of every reference image it names."""
    digests = {}
    for fixture_id, f in fixtures.items():
        digest = hashlib.sha256()
        entry = [f.id, f.mode, list(f.references), f.width, f.height, f.prompt, f.negative_prompt]
        digest.update(json.dumps(entry, sort_keys=True).encode())
        for ref_path in f.reference_paths:
            digest.update(hashlib.sha256(ref_path.read_bytes()).digest())
        digests[fixture_id] = digest.hexdigest()
    return digests


def fixture_digest(fixtures: dict[str, Fixture]) -> str:
    """One sha256 for the whole set: over the sorted per-fixture digests."""
    return set_digest(fixture_digests(fixtures))


DEFAULT_SEEDS = "2301-2304"  # the probe's seeds when none are given


def parse_seeds(text: str) -> list[int]:
    """'2301-2304' or '1,2,5' or '1-3,9' -> sorted unique non-negative seeds."""
    seeds: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        try:
            low, _, high = part.partition("-")
            first, last = int(low), int(high or low)
            if first < 0 or last < first:
                raise ValueError
        except ValueError:
            raise InputError(f"--seeds: cannot read {part!r}; use e.g. 2301-2304 or 1,2,5") from None
        seeds.update(range(first, last + 1))
    return sorted(seeds)


def seeds_text(seeds: Sequence[int]) -> str:
    """``seeds`` as --seeds reads them (parse_seeds' inverse): a range when consecutive, else a comma list."""
    if list(seeds) == list(range(seeds[0], seeds[0] + len(seeds))):
        return f"{seeds[0]}-{seeds[-1]}"
    return ",".join(str(s) for s in seeds)
