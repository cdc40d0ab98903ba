"""Structure metrics against values worked out by hand on tiny arrays."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ditq.metrics import METRICS, banding_score, structure_metrics


def test_alpha_and_colour_numbers_match_hand_values() -> None:
    # 2x2 RGBA. alpha: 255, 255, 128, 0 -> opaque 2/4, translucent 1/4, mean 638/4 = 159.5
    image = np.array(
        [[[0, 10, 20, 255], [255, 10, 20, 255]], [[0, 30, 20, 128], [255, 30, 20, 0]]], dtype=np.uint8
    )
    s = structure_metrics(image)
    assert s["opaque_fraction"] == 0.5
    assert s["translucent_fraction"] == 0.25
    assert s["alpha_mean"] == 159.5
    # R = {0, 255, 0, 255}: std 127.5; G = {10, 10, 30, 30}: std 10; B constant: std 0
    assert s["rgb_std"] == [127.5, 10.0, 0.0]
    assert s["rgb_std_mean"] == pytest.approx((127.5 + 10.0) / 3, abs=0.01)
    # samples at 0 or 255: the four R values only -> 4 of 12
    assert s["clipped_fraction"] == pytest.approx(4 / 12, abs=1e-4)
    assert s["non_finite"] is False and s["flat"] is False


def test_rgb_without_alpha_counts_as_opaque() -> None:
    s = structure_metrics(np.full((4, 4, 3), 77, dtype=np.uint8))
    assert (s["opaque_fraction"], s["alpha_mean"], s["translucent_fraction"]) == (1.0, 255.0, 0.0)
    assert s["flat"] is True and s["rgb_std"] == [0.0, 0.0, 0.0]


def test_non_finite_values_are_flagged() -> None:
    image = np.full((4, 4, 4), 100.0)
    image[1, 2, 0] = np.nan
    assert structure_metrics(image)["non_finite"] is True
    image[1, 2, 0] = np.inf
    assert structure_metrics(image)["non_finite"] is True


def test_banding_score_hand_values() -> None:
    rows = np.zeros((6, 6, 3))
    rows[1::2] = 90.0  # rows alternate 0 / 90: V = 90, H = 0 -> (90 - 0) / 90 = 1
    assert banding_score(rows) == 1.0
    assert banding_score(rows.transpose(1, 0, 2)) == -1.0  # vertical stripes
    assert banding_score(np.full((6, 6, 3), 5.0)) == 0.0  # no change at all
    checker = (np.indices((6, 6)).sum(axis=0) % 2 * 50.0)[..., None].repeat(3, axis=2)
    assert banding_score(checker) == 0.0  # V = H = 50
    # rows ramp by 3 per row, columns by 1 per column: V = 3, H = 1 -> 2 / 4
    ramp = (3.0 * np.arange(5)[:, None] + np.arange(7)[None, :])[..., None].repeat(3, axis=2)
    assert banding_score(ramp) == pytest.approx(0.5)


def test_banding_score_of_noise_is_near_zero() -> None:
    noise = np.random.default_rng(0).integers(0, 256, size=(64, 64, 3)).astype(np.uint8)
    assert abs(banding_score(noise)) < 0.05


def test_every_metric_declares_its_direction() -> None:
    keys = set(structure_metrics(np.zeros((4, 4, 4), dtype=np.uint8)))
    assert keys <= set(METRICS)
    assert METRICS["psnr_db"].higher_is_better is True
    assert METRICS["banding_score"].higher_is_better is False
    assert METRICS["lpips"].higher_is_better is False
    assert not math.isnan(banding_score(np.zeros((1, 5, 3))))


def _images() -> list[np.ndarray]:
    rng = np.random.default_rng(5)
    masked = rng.integers(0, 256, (40, 40, 4), dtype=np.uint8)
    masked[..., 3] = rng.choice(np.array([0, 128, 255], dtype=np.uint8), (40, 40))
    ramp = np.linspace(0, 255, 96)
    return [
        rng.integers(0, 256, (64, 48, 4), dtype=np.uint8),
        rng.integers(0, 256, (64, 48, 3), dtype=np.uint8),
        rng.integers(250, 256, (33, 17, 1), dtype=np.uint8),
        np.full((8, 8, 3), 7, dtype=np.uint8),
        np.zeros((1, 5, 3), dtype=np.uint8),
        masked,
        np.stack([np.add.outer(ramp, ramp) / 2] * 3, axis=-1).astype(np.uint8),
        np.repeat(rng.integers(0, 256, (32, 1, 3), dtype=np.uint8), 32, axis=1),  # horizontal stripes
    ]


@pytest.mark.parametrize("index", range(len(_images())))
def test_an_8_bit_image_gets_the_numbers_of_its_float_copy(index: int) -> None:
    """8-bit images (every served and probed one) take an integer path; its numbers are the float64 path's."""
    image = _images()[index]
    assert structure_metrics(image) == structure_metrics(image.astype(np.float64))
