"""PSNR, SSIM and compositing against values worked out by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ditq.metrics import composite_over_white, fidelity_arrays, psnr, ssim

C1, C2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2


def test_psnr_hand_values() -> None:
    a = np.zeros((4, 4, 3), dtype=np.uint8)
    b = a + 5  # MSE 25 -> 10 log10(65025 / 25) = 34.151 dB
    assert psnr(a, b) == pytest.approx(10 * math.log10(65025 / 25))
    assert psnr(a, a) == math.inf
    half = a.copy()
    half[:2] = 10  # half the samples off by 10: MSE 50
    assert psnr(a, half) == pytest.approx(10 * math.log10(65025 / 50))
    with pytest.raises(ValueError, match="shapes differ"):
        psnr(a, np.zeros((4, 5, 3)))


def test_ssim_of_identical_images_is_one() -> None:
    x = np.random.default_rng(1).integers(0, 256, size=(20, 24, 3)).astype(np.uint8)
    assert ssim(x, x) == pytest.approx(1.0)


def test_ssim_constant_images_hand_value() -> None:
    # No variance anywhere: SSIM = (2 mx my + C1) / (mx^2 + my^2 + C1) * (C2 / C2)
    x, y = np.full((16, 16, 1), 100.0), np.full((16, 16, 1), 110.0)
    expected = (2 * 100 * 110 + C1) / (100**2 + 110**2 + C1)
    assert ssim(x, y) == pytest.approx(expected, rel=1e-9)


def test_ssim_mirrored_pattern_hand_value() -> None:
    # One 11x11 window. p = sign(column - 5): antisymmetric, so its gaussian-weighted mean is 0.
    # x = m + s p, y = m - s p: equal means, var_x = var_y = s^2 (1 - g5), cov = -var_x,
    # where g5 is the centre tap of the normalised 1-D gaussian (sigma 1.5): the centre column's weight.
    m, s = 120.0, 40.0
    p = np.sign(np.arange(11) - 5.0)[None, :].repeat(11, axis=0)
    x, y = (m + s * p)[..., None], (m - s * p)[..., None]
    g5 = 1.0 / sum(math.exp(-(k * k) / (2 * 1.5**2)) for k in range(-5, 6))
    v = s * s * (1.0 - g5)
    assert ssim(x, y) == pytest.approx((C2 - 2 * v) / (C2 + 2 * v), rel=1e-9)


def test_composite_over_white_hand_value() -> None:
    pixel = np.array([[[100, 0, 255, 128]]], dtype=np.uint8)
    # c * a + 255 * (1 - a), a = 128/255: 100 -> 177.196 -> 177; 0 -> 127.0 -> 127; 255 -> 255
    assert composite_over_white(pixel).tolist() == [[[177, 127, 255]]]
    rgba, rgb = np.zeros((2, 2, 4), dtype=np.uint8), np.zeros((2, 2, 3), dtype=np.uint8)
    assert fidelity_arrays(rgba, rgba, "RGBA", "RGBA")[0].shape[2] == 4
    assert fidelity_arrays(rgba, rgb, "RGBA", "RGB")[0].shape[2] == 3
