"""Image grids: per candidate and fixture, one row per seed: baseline | candidate | difference.

Images are composited over white (as compare does when alpha differs) so a collapsed, transparent output looks as
empty as it is. The difference is the mean absolute RGB error per pixel, on a square-root scale that reaches the
top of a perceptual colour map at ``FULL_SCALE`` levels of 255 (``DIFFERENCE_SCALE`` says so under every grid): a
difference of one or two levels, which is what a 45 dB PSNR is, shows as a clear purple, where a linear x4 left it
black. The first screen's grid (``write_lead_grid``) is one row: the worst seed of the worst fixture.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib import colormaps
from PIL import Image, ImageDraw

from ditq.errors import InputError
from ditq.pictures import open_picture
from ditq.report.model import Candidate, RunData

__all__ = [
    "CELL",
    "DIFFERENCE_SCALE",
    "FULL_SCALE",
    "Grid",
    "difference_heatmap",
    "write_grids",
    "write_lead_grid",
]

# |difference| at which the colour map tops out (levels of 255); below it the map follows sqrt(|difference| / this)
FULL_SCALE = 8.0
DIFFERENCE_SCALE = f"|difference|: black 0, sqrt scale, yellow at {FULL_SCALE:g}/255 or more"
CELL = 192  # pixels per grid cell side (small images are scaled up, nearest neighbour)
_LABEL_H = 18
_GAP = 4


@dataclass(frozen=True)
class Grid:
    candidate: str
    fixture_id: str
    path: Path
    seeds: tuple[int, ...]
    lead: bool = False  # the first screen's: the worst seed of the worst fixture, one row


def _over_white(image: Image.Image) -> np.ndarray:
    rgba = np.asarray(image.convert("RGBA"), dtype=np.float32)
    alpha = rgba[..., 3:4] / 255.0
    return rgba[..., :3] * alpha + 255.0 * (1.0 - alpha)  # (H, W, 3) float32 0..255


def difference_heatmap(
    baseline: Image.Image, candidate: Image.Image, full_scale: float = FULL_SCALE
) -> Image.Image:
    """(H, W) mean |baseline - candidate| over RGB, as sqrt(error / ``full_scale``) clipped to 1, through the
    inferno map, as RGB."""
    error = np.abs(_over_white(baseline) - _over_white(candidate)).mean(axis=2)
    scaled = np.sqrt(np.clip(error / full_scale, 0.0, 1.0))
    colored = colormaps["inferno"](scaled)[..., :3]  # (H, W, 3) float 0..1
    return Image.fromarray((colored * 255.0 + 0.5).astype(np.uint8), "RGB")


def _fit(image: Image.Image) -> Image.Image:
    scale = CELL / max(image.size)
    size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
    resample = Image.Resampling.NEAREST if scale >= 1 else Image.Resampling.LANCZOS
    white = Image.new("RGB", image.size, "white")
    white.paste(image.convert("RGBA"), mask=image.convert("RGBA").getchannel("A"))
    return white.resize(size, resample)


def _placeholder(text: str) -> Image.Image:
    cell = Image.new("RGB", (CELL, CELL), (225, 225, 225))
    ImageDraw.Draw(cell).multiline_text((8, CELL // 2 - 12), text, fill=(90, 90, 90))
    return cell


def _open(path: Path | None) -> Image.Image | str | None:
    """The image at ``path``; None where there is none; why not where it cannot be decoded (a truncated or
    altered file is a cell that says so, not the end of the report: compare records it as an error row)."""
    if path is None:
        return None
    try:
        return open_picture(path)  # PNG, JPEG or WebP by signature, pixels bounded (ditq.pictures)
    except InputError as error:
        return f"{path.name}\ncannot be decoded\n({str(error).removeprefix(f'{path}: ')[:48]})"


def _row(baseline: RunData, run: RunData, fixture_id: str, seed: int, failure: str) -> list[Image.Image]:
    base = _open(baseline.image(fixture_id, seed))
    cand = _open(run.image(fixture_id, seed))
    left = (
        _placeholder(base)
        if isinstance(base, str)
        else _fit(base)
        if base
        else _placeholder("no baseline image")
    )
    middle = _placeholder(cand) if isinstance(cand, str) else _fit(cand) if cand else _placeholder(failure)
    if not isinstance(base, Image.Image) or not isinstance(cand, Image.Image):
        right = _placeholder("no difference")
    elif base.size != cand.size:
        right = _placeholder(f"sizes differ\n{base.size} vs {cand.size}")
    else:
        right = _fit(difference_heatmap(base, cand))
    return [left, middle, right]


def _compose(titles: list[str], rows: list[tuple[str, list[Image.Image]]]) -> Image.Image:
    width = _GAP + len(titles) * (CELL + _GAP) + 70
    height = _LABEL_H + len(rows) * (CELL + _GAP) + _GAP
    sheet = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(sheet)
    for column, title in enumerate(titles):
        draw.text((70 + _GAP + column * (CELL + _GAP), 3), title, fill=(0, 0, 0))
    for index, (label, cells) in enumerate(rows):
        top = _LABEL_H + index * (CELL + _GAP)
        draw.text((4, top + CELL // 2 - 6), label, fill=(0, 0, 0))
        for column, cell in enumerate(cells):
            sheet.paste(cell, (70 + _GAP + column * (CELL + _GAP), top))
    return sheet


def _failure_text(candidate: Candidate, run: RunData, fixture_id: str, seed: int) -> str:
    record = next((r for r in run.records if r.key == (fixture_id, seed)), None)
    if record is None:
        return "not requested"
    if record.out_of_memory:
        return "out of memory"
    if not record.ok:
        return f"failed (HTTP {record.http})" if record.http else "failed"
    return "no image saved"


def write_grids(baseline: Candidate, candidates: list[Candidate], out_dir: Path) -> list[Grid]:
    """One PNG per (candidate, fixture) with images; run directories without images get none."""
    if baseline.run is None or not baseline.run.has_images:
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    grids = []
    for candidate in candidates:
        run = candidate.run
        if run is None or not run.has_images:
            continue
        references = {r.fixture_id: r.n_references for r in run.records}
        fixtures = sorted(references, key=lambda f: (references[f], f))
        for fixture_id in fixtures:
            seeds = sorted(r.seed for r in run.records if r.fixture_id == fixture_id)
            rows = [
                (
                    f"seed {seed}",
                    _row(
                        baseline.run, run, fixture_id, seed, _failure_text(candidate, run, fixture_id, seed)
                    ),
                )
                for seed in seeds
            ]
            sheet = _compose([baseline.name, candidate.name, _DIFFERENCE_TITLE], rows)
            path = out_dir / f"{_safe(candidate.name)}--{_safe(fixture_id)}.png"
            sheet.save(path, format="PNG", optimize=True)
            grids.append(Grid(candidate.name, fixture_id, path, tuple(seeds)))
    return grids


_DIFFERENCE_TITLE = f"|difference|, sqrt, max {FULL_SCALE:g}/255"


def _worst(candidate: Candidate) -> tuple[str, int] | None:
    """(fixture, seed) of the candidate's lowest PSNR: the fixture whose mean PSNR is lowest, its lowest seed;
    without compare's numbers, its first request with an image; None without any."""
    run = candidate.run
    if run is None or not run.has_images:
        return None
    rows = [r for r in run.fidelity or [] if r.psnr_db is not None]
    if rows:
        means = {
            f: np.mean([r.psnr_db for r in rows if r.fixture_id == f]) for f in {r.fixture_id for r in rows}
        }
        fixture = min(sorted(means), key=lambda f: means[f])
        worst = min((r for r in rows if r.fixture_id == fixture), key=lambda r: (r.psnr_db, r.seed))
        return fixture, worst.seed
    first = next((r for r in sorted(run.records, key=lambda r: r.key) if run.image(*r.key)), None)
    return None if first is None else first.key


def write_lead_grid(baseline: Candidate, candidate: Candidate | None, out_dir: Path) -> Grid | None:
    """The first screen's grid: baseline | candidate | difference for the candidate's worst seed of its worst
    fixture (``_worst``), one row; None where there is nothing to show."""
    worst = None if candidate is None or baseline.run is None else _worst(candidate)
    if candidate is None or candidate.run is None or baseline.run is None or worst is None:
        return None
    fixture_id, seed = worst
    failure = _failure_text(candidate, candidate.run, fixture_id, seed)
    row = _row(baseline.run, candidate.run, fixture_id, seed, failure)
    sheet = _compose([baseline.name, candidate.name, _DIFFERENCE_TITLE], [(f"seed {seed}", row)])
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"lead--{_safe(candidate.name)}--{_safe(fixture_id)}.png"
    sheet.save(path, format="PNG", optimize=True)
    return Grid(candidate.name, fixture_id, path, (seed,), lead=True)


def _safe(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)
