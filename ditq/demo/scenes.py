"""Procedural scenes and tasks: shapes of given colors, sizes, positions and counts on plain backgrounds.

Tasks (what the model learns and what the evaluation asks):
- "t2i": a prompt names 1-3 groups (count, color, shape; at most 4 objects) and a background; the objects appear
  in the order listed, at the slots compose uses (below) jittered by up to 2 px, with random sizes.
- "recolor": reference 1 is a cut-out sprite (transparent background); the result keeps its shape, centered and
  larger, in the color and on the background the prompt names.
- "compose": references 1..k (k = 1..4) are sprites; the result puts their objects, in order, at fixed places
  (k=1 center, 2 left/right, 3 two above one, 4 a 2x2 grid) on the background the prompt names.
Rendering is vectorized torch (CPU or GPU), anti-aliased by supersampling; sampling uses a numpy Generator.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from ditq.demo.words import BACKGROUND_COLORS, COUNT_WORDS, OBJECT_COLORS, SHAPES

__all__ = [
    "CANVAS",
    "REFERENCE_CANVAS",
    "TASK_KINDS",
    "Expectation",
    "Scene",
    "SceneObject",
    "Task",
    "rasterize",
    "render_scenes",
    "sample_kind",
    "sample_task",
    "scene_arrays",
]

CANVAS = 64  # target images are CANVAS x CANVAS
REFERENCE_CANVAS = 32  # reference sprites are REFERENCE_CANVAS x REFERENCE_CANVAS
_VERTICES = 24  # every shape is a polygon padded to this many vertices
# (kind, references): the task mix used for training and evaluation, with weights.
TASK_KINDS: dict[tuple[str, int], float] = {
    ("t2i", 0): 0.50,
    ("recolor", 1): 0.10,
    ("compose", 1): 0.03,
    ("compose", 2): 0.11,
    ("compose", 3): 0.12,
    ("compose", 4): 0.14,
}
_COMPOSE_CENTERS: dict[int, list[tuple[float, float]]] = {  # (x, y) on the 64 canvas
    1: [(32, 32)],
    2: [(17, 32), (47, 32)],
    3: [(17, 19), (47, 19), (32, 46)],
    4: [(17, 17), (47, 17), (17, 47), (47, 47)],
}
# t2i: objects in the order the prompt lists them, at the same slots as compose, jittered, sizes drawn per count
_T2I_SIZES: dict[int, tuple[float, float]] = {
    1: (22.0, 40.0),
    2: (16.0, 26.0),
    3: (15.0, 23.0),
    4: (15.0, 23.0),
}
_T2I_JITTER = 2.0
_RECOLOR_SCALE = 1.6  # a single object is drawn 1.6x its reference size


@dataclass(frozen=True)
class SceneObject:
    shape: str
    color: str
    center: tuple[float, float]  # (x, y) in pixels
    size: float  # side of the bounding box in pixels


@dataclass(frozen=True)
class Scene:
    background: str | None  # None: transparent (a cut-out sprite)
    objects: tuple[SceneObject, ...]
    canvas: int = CANVAS


@dataclass(frozen=True)
class Expectation:
    """What a correct result shows: the background and how many objects of each (shape, color)."""

    background: str
    objects: Counter[tuple[str, str]] = field(default_factory=Counter)


@dataclass(frozen=True)
class Task:
    kind: str
    prompt: str
    references: tuple[Scene, ...]
    target: Scene
    expectation: Expectation


def _polygon(shape: str, center: tuple[float, float], size: float) -> np.ndarray:
    """(_VERTICES, 2) polygon of `shape`, upright, fitting a `size` box around `center`."""
    cx, cy, half = center[0], center[1], size / 2
    if shape == "circle":
        angles = np.linspace(0, 2 * math.pi, _VERTICES, endpoint=False)
        points = np.stack([cx + half * np.cos(angles), cy + half * np.sin(angles)], axis=1)
    elif shape == "square":
        points = np.array(
            [[cx - half, cy - half], [cx + half, cy - half], [cx + half, cy + half], [cx - half, cy + half]]
        )
    elif shape == "triangle":
        points = np.array([[cx, cy - half], [cx + half, cy + half], [cx - half, cy + half]])
    elif shape == "star":  # 5 points, inner radius 0.45 of outer, nudged down to center its bounding box
        radius, offset = half * 1.05, half * 0.1
        angles = -math.pi / 2 + np.arange(10) * math.pi / 5
        radii = np.where(np.arange(10) % 2 == 0, radius, 0.45 * radius)
        points = np.stack([cx + radii * np.cos(angles), cy + offset + radii * np.sin(angles)], axis=1)
    else:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    padding = np.repeat(points[-1:], _VERTICES - len(points), axis=0)
    return np.concatenate([points, padding]).astype(np.float32)


def _coverage(polygons: torch.Tensor, canvas: int, supersample: int) -> torch.Tensor:
    """(N, V, 2) polygons -> (N, canvas, canvas) coverage in [0, 1] (even-odd rule at sub-pixel centers)."""
    fine = canvas * supersample
    coords = (torch.arange(fine, device=polygons.device, dtype=torch.float32) + 0.5) / supersample
    x0, y0 = polygons[:, None, :, 0], polygons[:, None, :, 1]  # (N, 1, V)
    following = polygons.roll(-1, dims=1)
    x1, y1 = following[:, None, :, 0], following[:, None, :, 1]
    py = coords.view(1, fine, 1)
    straddles = (y0 > py) != (y1 > py)  # (N, fine rows, V): edge crosses this row
    crossing_x = x0 + (py - y0) * (x1 - x0) / torch.where(y1 == y0, torch.ones_like(y1), y1 - y0)
    crossing_x = torch.where(
        straddles, crossing_x, torch.full_like(crossing_x, -1.0)
    )  # -1: left of every pixel
    # points right of an odd number of crossings are inside: (N, rows, 1, V) vs (1, 1, cols, 1); counted in uint8
    # (at most _VERTICES crossings), whose sum of booleans runs about three times as fast as the default int64's
    inside = ((coords.view(1, 1, fine, 1) < crossing_x[:, :, None, :]).sum(-1, dtype=torch.uint8) % 2).float()
    return torch.nn.functional.avg_pool2d(inside[:, None], supersample)[:, 0]


def scene_arrays(scenes: list[Scene]) -> dict[str, np.ndarray]:
    """Scenes -> plain arrays (cheap to send between processes): polygons (B, S, V, 2), colors (B, S, 3),
    present (B, S), base (B, 4) background RGBA in 0..255 (zeros: transparent)."""
    batch, slots = len(scenes), max(1, max(len(scene.objects) for scene in scenes))
    polygons = np.zeros((batch, slots, _VERTICES, 2), np.float32)
    colors = np.zeros((batch, slots, 3), np.float32)
    present = np.zeros((batch, slots), np.float32)
    base = np.zeros((batch, 4), np.float32)
    for row, scene in enumerate(scenes):
        if scene.background is not None:
            base[row] = [*BACKGROUND_COLORS[scene.background], 255]
        for slot, item in enumerate(scene.objects):
            polygons[row, slot] = _polygon(item.shape, item.center, item.size)
            colors[row, slot] = OBJECT_COLORS[item.color]
            present[row, slot] = 1.0
    return {"polygons": polygons, "colors": colors, "present": present, "base": base}


def rasterize(
    arrays: dict[str, np.ndarray] | dict[str, torch.Tensor],
    canvas: int,
    device: torch.device | str = "cpu",
    supersample: int = 2,
) -> torch.Tensor:
    """`scene_arrays` output -> (B, 4, canvas, canvas) RGBA in [-1, 1]; objects painted in order."""
    polygons, colors, present, base = (
        torch.as_tensor(arrays[key]).to(device=device, dtype=torch.float32)
        for key in ("polygons", "colors", "present", "base")
    )
    batch, slots = present.shape
    coverage = _coverage(polygons.flatten(0, 1), canvas, supersample)
    coverage = coverage.view(batch, slots, 1, canvas, canvas) * present[..., None, None, None]
    image = (base / 255)[:, :, None, None].expand(batch, 4, canvas, canvas).clone()
    paint = torch.cat([colors / 255, torch.ones_like(colors[..., :1])], dim=2)
    for slot in range(slots):
        cover = coverage[:, slot]  # (B, 1, C, C)
        image = image * (1 - cover) + paint[:, slot, :, None, None] * cover
    return image * 2 - 1


def render_scenes(
    scenes: list[Scene], device: torch.device | str = "cpu", supersample: int = 2
) -> torch.Tensor:
    """Scenes of one canvas size -> (B, 4, C, C) RGBA in [-1, 1]."""
    return rasterize(scene_arrays(scenes), scenes[0].canvas, device, supersample)


def sample_kind(rng: np.random.Generator) -> tuple[str, int]:
    """A (kind, references) pair drawn with the `TASK_KINDS` weights."""
    kinds = list(TASK_KINDS)
    weights = np.array([TASK_KINDS[kind] for kind in kinds])
    return kinds[int(np.searchsorted(np.cumsum(weights) / weights.sum(), rng.random()))]


def _pick(rng: np.random.Generator, options: Iterable[str]) -> str:
    items = list(options)
    return items[int(rng.integers(len(items)))]


def _separated(centers: list[tuple[float, float]], sizes: list[float]) -> bool:
    """True when every pair of bounding boxes is at least 2 px apart (so objects stay separate components)."""
    boxes = list(zip(centers, sizes, strict=True))
    return all(
        max(abs(ax - bx), abs(ay - by)) > (asize + bsize) / 2 + 2
        for index, ((ax, ay), asize) in enumerate(boxes)
        for (bx, by), bsize in boxes[index + 1 :]
    )


def _layout(
    rng: np.random.Generator, sizes_range: tuple[float, float], count: int
) -> tuple[list, list[float]]:
    """Jittered slot centers (`_COMPOSE_CENTERS`) and random sizes for `count` separated objects."""
    low, high = sizes_range
    while True:
        sizes = [low + (high - low) * rng.random() for _ in range(count)]
        centers = [
            (x + _T2I_JITTER * (2 * rng.random() - 1), y + _T2I_JITTER * (2 * rng.random() - 1))
            for x, y in _COMPOSE_CENTERS[count]
        ]
        if _separated(centers, sizes):
            return centers, sizes


def _count_phrase(count: int, color: str, shape: str, rng: np.random.Generator) -> str:
    word = "one" if count == 1 and rng.random() < 0.3 else COUNT_WORDS[count]
    return f"{word} {color} {shape}{'s' if count > 1 else ''}"


def _t2i(rng: np.random.Generator) -> Task:
    num_groups = 1 + int(np.searchsorted(np.cumsum([0.45, 0.42]), rng.random()))
    kinds = [(str(s), str(c)) for s in SHAPES for c in OBJECT_COLORS]
    chosen = [kinds[i] for i in rng.choice(len(kinds), size=num_groups, replace=False)]
    counts = [1] * num_groups
    for _ in range(int(rng.integers(0, 4 - num_groups + 1))):
        counts[int(rng.integers(num_groups))] += 1
    background = _pick(rng, BACKGROUND_COLORS)
    total = sum(counts)
    centers, sizes = _layout(rng, _T2I_SIZES[total], total)
    kinds_flat = [kind for kind, count in zip(chosen, counts, strict=True) for _ in range(count)]
    objects = tuple(
        SceneObject(s, c, xy, size) for (s, c), xy, size in zip(kinds_flat, centers, sizes, strict=True)
    )
    phrases = [
        _count_phrase(count, color, shape, rng) for (shape, color), count in zip(chosen, counts, strict=True)
    ]
    listing = phrases[0] if len(phrases) == 1 else ", ".join(phrases[:-1]) + " and " + phrases[-1]
    template = _pick(
        rng, ["{objects} on a {background} background", "a {background} background with {objects}"]
    )
    prompt = template.format(objects=listing, background=background)
    expected = Counter(dict(zip(chosen, counts, strict=True)))
    return Task("t2i", prompt, (), Scene(background, objects), Expectation(background, expected))


def _sprite(rng: np.random.Generator, shape: str, color: str) -> tuple[Scene, float]:
    size = float(rng.uniform(16, 26))
    jitter = rng.uniform(-1.5, 1.5, size=2)
    center = (REFERENCE_CANVAS / 2 + float(jitter[0]), REFERENCE_CANVAS / 2 + float(jitter[1]))
    return Scene(None, (SceneObject(shape, color, center, size),), REFERENCE_CANVAS), size


def _recolor(rng: np.random.Generator) -> Task:
    shape, old = _pick(rng, SHAPES), _pick(rng, OBJECT_COLORS)
    new = _pick(rng, [color for color in OBJECT_COLORS if color != old])
    background = _pick(rng, BACKGROUND_COLORS)
    sprite, size = _sprite(rng, shape, old)
    target = Scene(background, (SceneObject(shape, new, (32.0, 32.0), size * _RECOLOR_SCALE),))
    template = _pick(
        rng,
        [
            "make the object from picture 1 {color} on a {background} background",
            "change the color of the object in picture 1 to {color} on a {background} background",
        ],
    )
    prompt = template.format(color=new, background=background)
    return Task("recolor", prompt, (sprite,), target, Expectation(background, Counter({(shape, new): 1})))


def _compose(rng: np.random.Generator, k: int) -> Task:
    background = _pick(rng, BACKGROUND_COLORS)
    kinds = [(_pick(rng, SHAPES), _pick(rng, OBJECT_COLORS)) for _ in range(k)]
    sprites, objects = [], []
    for (shape, color), center in zip(kinds, _COMPOSE_CENTERS[k], strict=True):
        sprite, size = _sprite(rng, shape, color)
        sprites.append(sprite)
        objects.append(SceneObject(shape, color, center, size * (_RECOLOR_SCALE if k == 1 else 1.0)))
    if k == 1:
        prompt = f"put the object from picture 1 on a {background} background"
    else:
        numbers = " ".join(str(i) for i in range(1, k)) + f" and {k}"
        prompt = f"put the objects from pictures {numbers} together on a {background} background"
    return Task(
        "compose",
        prompt,
        tuple(sprites),
        Scene(background, tuple(objects)),
        Expectation(background, Counter(kinds)),
    )


def sample_task(rng: np.random.Generator, kind: str, references: int) -> Task:
    """One task of `kind` ("t2i", "recolor", "compose") with `references` reference images."""
    if kind == "t2i":
        return _t2i(rng)
    if kind == "recolor":
        return _recolor(rng)
    if kind == "compose":
        return _compose(rng, references)
    raise ValueError(f"unknown task kind {kind!r}; known: t2i, recolor, compose")
