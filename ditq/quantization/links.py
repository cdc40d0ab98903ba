"""How an artifact holds the source entries it does not rewrite: a relative link, a copy, or an absolute link.

Every top-level entry of the source but ``model_index.json`` (copied) and the rewritten components (a text
encoder, the VAE, the scheduler, a tokenizer, a README) is held one of three ways, decided here once for every
writer of an artifact (``place_entries``), so that an artifact survives being moved wherever it can:

- **relative link** (``../qwen/vae``), when the source sits *beside* the artifact: the nearest folder that holds
  both is the artifact's parent or grandparent, and not the filesystem root (``models/qwen`` with
  ``models/qwen-w8a8``, or ``models/qwen`` with ``artifacts/qwen-w8a8``). Moving or copying that folder keeps
  the artifact whole; moving the artifact alone breaks its links, and ``ditq verify`` names each one.
- **copy**, when the source is not beside it and the entry holds at most ``COPY_MAX_BYTES`` (1 GiB, summed over
  its files): a scheduler, a tokenizer, a VAE, a CLIP text encoder. The artifact carries them wherever it goes.
- **absolute link**, for a larger entry (a T5 or Qwen text encoder) of a source that is not beside it, with a
  warning: the artifact then needs the source where it is, and ``--copy`` copies it instead.

``mode`` chooses explicitly: ``"link"`` links every entry by its absolute path (the artifact then moves anywhere
while the source stays where it is), ``"copy"`` copies every entry (the artifact moves anywhere alone);
``"auto"`` (the default) is the rule above. Paths are compared
resolved, so a source reached through a link (a hub snapshot behind ``models/qwen``) is where it really lies.
A link's target is written relative to the final artifact, not the temporary it is written in: both are in the
same folder.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ditq.errors import InputError

__all__ = [
    "COPY_MAX_BYTES",
    "LINK_MODES",
    "MAX_CLIMB",
    "Placement",
    "is_beside",
    "place_entries",
    "plan_entries",
]

log = logging.getLogger(__name__)

LinkMode = Literal["auto", "link", "copy"]
LINK_MODES: tuple[LinkMode, ...] = ("auto", "link", "copy")
COPY_MAX_BYTES = 1024**3  # an entry up to this size is copied where it cannot be linked relatively
MAX_CLIMB = 2  # a relative link starts with at most this many "..": the parent (1) or grandparent (2)

RELATIVE, ABSOLUTE, COPY = "relative link", "absolute link", "copy"


@dataclass(frozen=True)
class Placement:
    """How one entry of the source is held in the artifact."""

    name: str
    how: str  # RELATIVE, ABSOLUTE or COPY
    target: str | None  # a link's target as written (relative to the artifact, or absolute); None for a copy
    bytes: int


def is_beside(source: Path, output: Path) -> bool:
    """Whether ``source`` lies within the artifact ``output``'s parent or grandparent folder (``MAX_CLIMB``), that
    folder not the filesystem root. Both paths resolved."""
    common = Path(os.path.commonpath([source, output]))
    return common != Path(common.anchor) and len(output.relative_to(common).parts) <= MAX_CLIMB


def entry_bytes(path: Path) -> int:
    """The bytes of the files at ``path`` (a file, or a folder walked through its links)."""
    if not path.is_dir():
        return path.stat().st_size
    return sum(
        (Path(folder) / name).stat().st_size
        for folder, _, names in os.walk(path, followlinks=True)
        for name in names
    )


def plan_entries(
    source: Path,
    output: Path,
    names: list[str],
    mode: str = "auto",
    copy_max_bytes: int = COPY_MAX_BYTES,
) -> list[Placement]:
    """How each entry ``names`` of ``source`` is held in the artifact ``output`` (both resolved)."""
    if mode not in LINK_MODES:
        raise InputError(f"links: {mode!r} is not one of {', '.join(LINK_MODES)}")
    beside = is_beside(source, output)
    placements = []
    for name in names:
        size = entry_bytes(source / name)
        if mode == "copy" or (mode == "auto" and not beside and size <= copy_max_bytes):
            placements.append(Placement(name, COPY, None, size))
        elif mode == "auto" and beside:
            placements.append(Placement(name, RELATIVE, os.path.relpath(source / name, output), size))
        else:
            placements.append(Placement(name, ABSOLUTE, str(source / name), size))
    return placements


def place_entries(
    source: Path,
    output: Path,
    tmp: Path,
    names: list[str],
    mode: str = "auto",
    copy_max_bytes: int = COPY_MAX_BYTES,
) -> dict[str, str]:
    """Link or copy each entry ``names`` of ``source`` into ``tmp`` (what becomes ``output``) as ``plan_entries``
    decides; returns each link's name -> its target as written (the manifest's ``linked``)."""
    linked: dict[str, str] = {}
    placements = plan_entries(source, output, names, mode, copy_max_bytes)
    for entry in placements:
        src, dst = source / entry.name, tmp / entry.name
        if entry.target is None:
            if src.is_dir():
                shutil.copytree(src, dst)
            else:
                shutil.copy2(src, dst)
            continue
        os.symlink(entry.target, dst, target_is_directory=src.is_dir())
        linked[entry.name] = entry.target
        if entry.how == ABSOLUTE and mode == "auto":
            log.warning(
                "%s: a link to %s (%s bytes, over the %s copied by default): the artifact needs the source "
                "where it is (--copy copies it)",
                output / entry.name,
                entry.target,
                f"{entry.bytes:,}",
                f"{copy_max_bytes:,}",
            )
    if placements:
        log.info("kept as they are: %s", ", ".join(f"{e.name} ({e.how})" for e in placements))
    return linked
