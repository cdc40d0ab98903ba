"""The demo fixtures: the seed's matrix (text-to-image, then edits with 1, 2, 3 and 4 references) in shapes.

`python -m ditq.demo.fixtures` rewrites ditq/demo/fixtures.json and ditq/demo/references/*.png from the data
below; `score_fixture` is the semantic scorer for one fixture's output (a task-accuracy metric for the harness).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from PIL import Image

from ditq.demo.packing import pixels_to_pil
from ditq.demo.scenes import REFERENCE_CANVAS, Expectation, Scene, SceneObject, render_scenes
from ditq.demo.scorer import Score, score_image

__all__ = ["FIXTURES", "REFERENCES", "expectation_of", "reference_image", "score_fixture", "write_fixtures"]

_CENTER = (REFERENCE_CANVAS / 2, REFERENCE_CANVAS / 2)
# reference id -> (shape, color, size in pixels) of the one object on a transparent 32x32 sprite
REFERENCES: dict[str, tuple[str, str, float]] = {
    "ref-star-red": ("star", "red", 24.0),
    "ref-circle-green": ("circle", "green", 22.0),
    "ref-square-blue": ("square", "blue", 20.0),
    "ref-triangle-yellow": ("triangle", "yellow", 22.0),
}
_FOUR = ["ref-star-red", "ref-circle-green", "ref-square-blue", "ref-triangle-yellow"]


def _fixture(prompt: str, references: list[str], **extra: str) -> dict[str, Any]:
    mode = "edit" if references else "generate"
    return {
        "mode": mode,
        "references": references,
        "width": 64,
        "height": 64,
        "prompt": prompt,
        "negative_prompt": None,
        **extra,
    }


# id -> fixture, in the seed's shape; expected background and objects are in `_EXPECTED`
FIXTURES: dict[str, dict[str, Any]] = {
    "generate-shapes": _fixture("a yellow star on a black background", []),
    "edit-recolor": _fixture("make the object from picture 1 blue on a white background", _FOUR[:1]),
    "edit-compose-pair": _fixture(
        "put the objects from pictures 1 and 2 together on a gray background", _FOUR[:2]
    ),
    "edit-compose-three": _fixture(
        "put the objects from pictures 1 2 and 3 together on a beige background",
        _FOUR[:3],
        derived_from="edit-compose-four minus ref-triangle-yellow; four->three wording",
    ),
    "edit-compose-four": _fixture(
        "put the objects from pictures 1 2 3 and 4 together on a white background", _FOUR
    ),
}
_EXPECTED: dict[str, tuple[str, list[tuple[str, str]]]] = {
    "generate-shapes": ("black", [("star", "yellow")]),
    "edit-recolor": ("white", [("star", "blue")]),
    "edit-compose-pair": ("gray", [("star", "red"), ("circle", "green")]),
    "edit-compose-three": ("beige", [("star", "red"), ("circle", "green"), ("square", "blue")]),
    "edit-compose-four": (
        "white",
        [("star", "red"), ("circle", "green"), ("square", "blue"), ("triangle", "yellow")],
    ),
}


def expectation_of(fixture_id: str) -> Expectation:
    if fixture_id not in _EXPECTED:
        raise KeyError(f"fixture {fixture_id!r} is not a demo fixture; known: {', '.join(_EXPECTED)}")
    background, objects = _EXPECTED[fixture_id]
    return Expectation(background, Counter(objects))


def score_fixture(fixture_id: str, image: Image.Image) -> Score:
    """Semantic score of `image` as the output of demo fixture `fixture_id`."""
    return score_image(image, expectation_of(fixture_id))


def reference_image(reference_id: str) -> Image.Image:
    shape, color, size = REFERENCES[reference_id]
    scene = Scene(None, (SceneObject(shape, color, _CENTER, size),), REFERENCE_CANVAS)
    return pixels_to_pil(render_scenes([scene])[0])


def write_fixtures(directory: Path) -> None:
    """Write fixtures.json and references/<id>.png under `directory`."""
    (directory / "references").mkdir(parents=True, exist_ok=True)
    (directory / "fixtures.json").write_text(json.dumps(FIXTURES, indent=2) + "\n")
    for reference_id in REFERENCES:
        reference_image(reference_id).save(directory / "references" / f"{reference_id}.png")


if __name__ == "__main__":
    write_fixtures(Path(__file__).resolve().parent)
