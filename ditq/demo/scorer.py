"""Semantic scorer: does an image show the requested background and (shape, color) objects? No learned model.

Recipe: background = median color of a 2-pixel border, named by the nearest background color; foreground =
pixels far from it; objects = 4-connected foreground components of at least `MIN_AREA` pixels; an object's color
= nearest object color to its core pixels' median; its shape from two numbers:
  solidity = area / convex-hull area   (a star is far from convex: ~0.6; the others ~0.9-1.0)
  fill     = area / bounding-box area  (square ~1.0, circle ~0.79, triangle ~0.5)
A result is correct when the background, the multiset of (shape, color) and the opacity all match.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image

from ditq.demo.scenes import Expectation
from ditq.demo.words import BACKGROUND_COLORS, OBJECT_COLORS

__all__ = ["MIN_AREA", "DetectedObject", "Score", "detect_objects", "score_image"]

MIN_AREA = 15  # pixels; smaller components are noise
FOREGROUND_DISTANCE = 60.0  # RGB distance from the background that makes a pixel foreground
CORE_DISTANCE = 100.0  # pixels this far from the background decide an object's color
MIN_OPACITY = 0.9  # mean alpha (0..1) below which an image is not an opaque picture


@dataclass(frozen=True)
class DetectedObject:
    shape: str
    color: str
    area: int
    center: tuple[float, float]  # (x, y)
    fill: float
    solidity: float


@dataclass(frozen=True)
class Score:
    correct: bool
    background: str
    objects: list[DetectedObject]
    opacity: float
    expected: Expectation
    attributes: dict[str, bool] = field(
        default_factory=dict
    )  # background, count, shapes, colors, objects, opaque

    def as_dict(self) -> dict[str, Any]:
        found = Counter((item.shape, item.color) for item in self.objects)
        return {
            "correct": self.correct,
            "attributes": self.attributes,
            "background": self.background,
            "expected_background": self.expected.background,
            "found": {f"{color} {shape}": count for (shape, color), count in sorted(found.items())},
            "expected": {
                f"{color} {shape}": count for (shape, color), count in sorted(self.expected.objects.items())
            },
            "opacity": round(self.opacity, 4),
        }


def _nearest(rgb: np.ndarray, palette: dict[str, tuple[int, int, int]]) -> str:
    names = list(palette)
    distances = np.linalg.norm(np.array([palette[name] for name in names], dtype=np.float64) - rgb, axis=1)
    return names[int(np.argmin(distances))]


def _components(mask: np.ndarray) -> list[np.ndarray]:
    """4-connected components of a (H, W) bool mask -> list of (n, 2) arrays of (row, col)."""
    seen = np.zeros_like(mask, dtype=bool)
    height, width = mask.shape
    found = []
    for row, col in zip(*np.nonzero(mask), strict=True):
        if seen[row, col]:
            continue
        stack, pixels = [(int(row), int(col))], []
        seen[row, col] = True
        while stack:
            r, c = stack.pop()
            pixels.append((r, c))
            for nr, nc in ((r + 1, c), (r - 1, c), (r, c + 1), (r, c - 1)):
                if 0 <= nr < height and 0 <= nc < width and mask[nr, nc] and not seen[nr, nc]:
                    seen[nr, nc] = True
                    stack.append((nr, nc))
        found.append(np.array(pixels))
    return found


def _hull_area(points: np.ndarray) -> float:
    """Area of the convex hull of (n, 2) points (monotone chain + shoelace)."""
    pts = sorted(set(map(tuple, points.tolist())))
    if len(pts) < 3:
        return 0.0

    def half(sequence: list[tuple[float, float]]) -> list[tuple[float, float]]:
        chain: list[tuple[float, float]] = []
        for p in sequence:
            while len(chain) >= 2:
                (ax, ay), (bx, by) = chain[-2], chain[-1]
                if (bx - ax) * (p[1] - ay) - (by - ay) * (p[0] - ax) > 0:
                    break
                chain.pop()
            chain.append(p)
        return chain

    hull = np.array(half(pts)[:-1] + half(pts[::-1])[:-1], dtype=np.float64)
    x, y = hull[:, 0], hull[:, 1]
    return float(abs(np.dot(x, np.roll(y, -1)) - np.dot(y, np.roll(x, -1))) / 2)


def _classify_shape(pixels: np.ndarray) -> tuple[str, float, float]:
    """(n, 2) (row, col) pixels -> (shape, fill, solidity)."""
    area = len(pixels)
    rows, cols = pixels[:, 0], pixels[:, 1]
    box = (rows.max() - rows.min() + 1) * (cols.max() - cols.min() + 1)
    corners = np.concatenate([pixels + offset for offset in ((0, 0), (0, 1), (1, 0), (1, 1))])
    solidity = area / max(_hull_area(corners), 1.0)
    fill = area / box
    if solidity < 0.8:
        return "star", fill, solidity
    if fill >= 0.93:
        return "square", fill, solidity
    if fill >= 0.66:
        return "circle", fill, solidity
    return "triangle", fill, solidity


def detect_objects(image: Image.Image) -> tuple[str, list[DetectedObject], float]:
    """-> (background name, objects found, opacity = mean alpha in 0..1)."""
    rgba = np.asarray(image.convert("RGBA"), dtype=np.float64)
    rgb, opacity = rgba[..., :3], float(rgba[..., 3].mean() / 255)
    border = np.concatenate(
        [
            rgb[:2].reshape(-1, 3),
            rgb[-2:].reshape(-1, 3),
            rgb[:, :2].reshape(-1, 3),
            rgb[:, -2:].reshape(-1, 3),
        ]
    )
    background_rgb = np.median(border, axis=0)
    distance = np.linalg.norm(rgb - background_rgb, axis=-1)
    objects = []
    for pixels in _components(distance > FOREGROUND_DISTANCE):
        if len(pixels) < MIN_AREA:
            continue
        colors = rgb[pixels[:, 0], pixels[:, 1]]
        core = colors[distance[pixels[:, 0], pixels[:, 1]] > CORE_DISTANCE]
        color = _nearest(np.median(core if len(core) else colors, axis=0), OBJECT_COLORS)
        shape, fill, solidity = _classify_shape(pixels)
        center = (float(pixels[:, 1].mean()), float(pixels[:, 0].mean()))
        objects.append(DetectedObject(shape, color, len(pixels), center, round(fill, 3), round(solidity, 3)))
    return _nearest(background_rgb, BACKGROUND_COLORS), objects, opacity


def score_image(image: Image.Image, expected: Expectation) -> Score:
    """Compare what `image` shows with `expected`; `attributes` says which parts agree."""
    background, objects, opacity = detect_objects(image)
    found = Counter((item.shape, item.color) for item in objects)
    want = expected.objects
    attributes = {
        "background": background == expected.background,
        "count": sum(found.values()) == sum(want.values()),
        "shapes": Counter(item.shape for item in objects)
        == Counter(s for (s, _), n in want.items() for _ in range(n)),
        "colors": Counter(item.color for item in objects)
        == Counter(c for (_, c), n in want.items() for _ in range(n)),
        "objects": found == want,
        "opaque": opacity >= MIN_OPACITY,
    }
    return Score(all(attributes.values()), background, objects, opacity, expected, attributes)
