"""The scorer on images drawn with PIL (independently of the demo's own renderer)."""

import math
from collections import Counter

import pytest
from PIL import Image, ImageDraw

from ditq.demo.scenes import Expectation
from ditq.demo.scorer import score_image
from ditq.demo.words import BACKGROUND_COLORS, OBJECT_COLORS


def _star(cx: float, cy: float, radius: float) -> list[tuple[float, float]]:
    return [
        (cx + r * math.cos(-math.pi / 2 + i * math.pi / 5), cy + r * math.sin(-math.pi / 2 + i * math.pi / 5))
        for i, r in enumerate([radius, 0.4 * radius] * 5)
    ]


def _draw(
    background: str, items: list[tuple[str, str, tuple[int, int], int]], alpha: int = 255
) -> Image.Image:
    image = Image.new("RGBA", (64, 64), (*BACKGROUND_COLORS[background], alpha))
    draw = ImageDraw.Draw(image)
    for shape, color, (cx, cy), size in items:
        fill, half = (*OBJECT_COLORS[color], alpha), size // 2
        box = (cx - half, cy - half, cx + half, cy + half)
        if shape == "circle":
            draw.ellipse(box, fill=fill)
        elif shape == "square":
            draw.rectangle(box, fill=fill)
        elif shape == "triangle":
            draw.polygon([(cx, cy - half), (cx + half, cy + half), (cx - half, cy + half)], fill=fill)
        else:
            draw.polygon(_star(cx, cy, half), fill=fill)
    return image


SCENE = [
    ("circle", "red", (14, 14), 16),
    ("square", "blue", (46, 14), 14),
    ("triangle", "green", (14, 46), 18),
    ("star", "yellow", (46, 46), 20),
]


def _expect(background: str, pairs: list[tuple[str, str]]) -> Expectation:
    return Expectation(background, Counter(pairs))


@pytest.mark.parametrize("background", sorted(BACKGROUND_COLORS))
def test_right_answer_is_scored_correct(background):
    image = _draw(background, SCENE)
    score = score_image(image, _expect(background, [(s, c) for s, c, _, _ in SCENE]))
    assert score.correct, score.as_dict()
    assert sorted((o.shape, o.color) for o in score.objects) == sorted((s, c) for s, c, _, _ in SCENE)


@pytest.mark.parametrize("size", [12, 16, 24, 40])
@pytest.mark.parametrize("shape", ["circle", "square", "triangle", "star"])
def test_single_shape_at_many_sizes(shape, size):
    image = _draw("gray", [(shape, "purple", (32, 32), size)])
    score = score_image(image, _expect("gray", [(shape, "purple")]))
    assert score.correct, score.as_dict()


@pytest.mark.parametrize(
    ("expected", "failed"),
    [
        (
            _expect(
                "white", [("circle", "orange"), ("square", "blue"), ("triangle", "green"), ("star", "yellow")]
            ),
            "colors",
        ),
        (
            _expect(
                "white", [("square", "red"), ("square", "blue"), ("triangle", "green"), ("star", "yellow")]
            ),
            "shapes",
        ),
        (_expect("white", [("circle", "red"), ("square", "blue"), ("triangle", "green")]), "count"),
        (
            _expect(
                "black", [("circle", "red"), ("square", "blue"), ("triangle", "green"), ("star", "yellow")]
            ),
            "background",
        ),
    ],
)
def test_wrong_answers_are_caught(expected, failed):
    score = score_image(_draw("white", SCENE), expected)
    assert not score.correct
    assert score.attributes[failed] is False
    assert score.attributes["opaque"] is True


def test_swapped_colors_fail_objects_even_when_colors_and_shapes_match():
    image = _draw("beige", [("circle", "red", (16, 32), 18), ("square", "blue", (48, 32), 18)])
    score = score_image(image, _expect("beige", [("circle", "blue"), ("square", "red")]))
    assert score.attributes["shapes"] and score.attributes["colors"]
    assert not score.attributes["objects"] and not score.correct


def test_touching_objects_do_not_count_twice():
    image = _draw("white", [("square", "red", (24, 32), 16), ("square", "red", (38, 32), 16)])
    score = score_image(image, _expect("white", [("square", "red"), ("square", "red")]))
    assert not score.correct and not score.attributes["count"]


def test_transparent_image_is_not_opaque():
    image = _draw("white", [("circle", "red", (32, 32), 20)], alpha=40)
    score = score_image(image, _expect("white", [("circle", "red")]))
    assert not score.attributes["opaque"] and not score.correct


def test_noise_speckles_are_ignored():
    image = _draw("black", [("star", "orange", (32, 32), 24)])
    image.putpixel((5, 5), (240, 220, 40, 255))
    image.putpixel((58, 50), (40, 80, 220, 255))
    assert score_image(image, _expect("black", [("star", "orange")])).correct


def test_scorer_accepts_every_rendered_evaluation_target():
    """The demo's own renders of the evaluation tasks are the right answers: the scorer must call them correct."""
    from ditq.demo.evaluate import evaluation_tasks
    from ditq.demo.packing import pixels_to_pil
    from ditq.demo.scenes import render_scenes

    tasks = evaluation_tasks(200, 200)
    images = render_scenes([task.target for task in tasks])
    wrong = [
        (task.prompt, score.as_dict()["found"])
        for task, pixels in zip(tasks, images, strict=True)
        if not (score := score_image(pixels_to_pil(pixels), task.expectation)).correct
    ]
    assert not wrong
