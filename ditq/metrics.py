"""Image metrics: structure (is this image intact?) and fidelity (how close is it to the baseline?).

Every metric is registered once in ``METRICS`` with its direction, so a gate or a
report never has to guess whether bigger is better. Images are numpy arrays of
shape (H, W, C), C in {1, 3, 4}, with values on the 0..255 scale (uint8 from a
PNG, or float for an in-process array that may hold non-finite values).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ditq.pictures import open_picture

__all__ = [
    "METRICS",
    "MetricInfo",
    "banding_score",
    "composite_over_white",
    "fidelity_arrays",
    "load_png_array",
    "psnr",
    "ssim",
    "structure_metrics",
    "structure_metrics_png",
]


@dataclass(frozen=True)
class MetricInfo:
    name: str
    higher_is_better: bool | None  # None: neither direction is "better" (a diagnostic)
    unit: str
    description: str


# One registry for every number the harness reports about an image.
METRICS: dict[str, MetricInfo] = {
    m.name: m
    for m in (
        MetricInfo(
            "opaque_fraction", True, "fraction", "share of pixels with alpha == 255 (1.0 without alpha)"
        ),
        MetricInfo("translucent_fraction", False, "fraction", "share of pixels with 0 < alpha < 255"),
        MetricInfo("alpha_mean", True, "0..255", "mean alpha (255 without alpha)"),
        MetricInfo("rgb_std", None, "0..255", "standard deviation of each of R, G, B over the image"),
        MetricInfo("rgb_std_mean", None, "0..255", "mean of the three channel standard deviations"),
        MetricInfo(
            "banding_score", False, "-1..1", "(V-H)/(V+H) of mean row-to-row V and column-to-column H change"
        ),
        MetricInfo("clipped_fraction", False, "fraction", "share of RGB samples at exactly 0 or 255"),
        MetricInfo("non_finite", False, "flag", "the array held NaN or infinity"),
        MetricInfo("flat", False, "flag", "every RGB channel has standard deviation below 1"),
        MetricInfo("psnr_db", True, "dB", "peak signal-to-noise ratio against the baseline image"),
        MetricInfo("ssim", True, "-1..1", "gaussian-window structural similarity against the baseline image"),
        MetricInfo(
            "lpips", False, "distance", "learned perceptual distance (AlexNet) against the baseline image"
        ),
    )
}

_FLAT_STD = 1.0  # below this in every channel an image is one colour


def load_png_array(data: bytes) -> tuple[np.ndarray, str]:
    """Decode image bytes (PNG, JPEG or WebP: ``ditq.pictures``) to (H, W, C) uint8 and its mode: RGBA where the
    image carries alpha (an alpha band or a transparency entry), else RGB."""
    with open_picture(data, "image") as image:
        target = "RGBA" if "A" in image.mode or image.info.get("transparency") is not None else "RGB"
        return np.asarray(image.convert(target)), target


def _channels(array: np.ndarray) -> np.ndarray:
    if array.ndim == 2:
        array = array[..., None]
    if array.ndim != 3 or array.shape[2] not in (1, 3, 4):
        raise ValueError(f"expected an (H, W, C) image with C in 1, 3, 4; got shape {array.shape}")
    return array


def banding_score(array: np.ndarray) -> float:
    """Horizontal-stripe detector on the RGB mean, in [-1, 1].

    V = mean |I[y+1, x] - I[y, x]| (change from one row to the next), H = the same
    along a row. Natural images score near 0; horizontal stripes (rows that are
    internally smooth but differ from their neighbours) approach 1; vertical
    stripes approach -1. An image with no change at all scores 0.
    """
    array = _channels(array)
    luma = np.nan_to_num(array[..., : min(3, array.shape[2])].astype(np.float64).mean(axis=2))
    if luma.shape[0] < 2 or luma.shape[1] < 2:
        return 0.0
    vertical = float(np.abs(np.diff(luma, axis=0)).mean())
    horizontal = float(np.abs(np.diff(luma, axis=1)).mean())
    total = vertical + horizontal
    return 0.0 if total == 0.0 else (vertical - horizontal) / total


def structure_metrics(array: np.ndarray) -> dict[str, Any]:
    """The structure numbers of one image; keys are names in ``METRICS``."""
    array = _channels(array)
    if array.dtype == np.uint8:
        return _structure_metrics_uint8(array)
    values = array.astype(np.float64)
    non_finite = bool(not np.isfinite(values).all())
    values = np.nan_to_num(values, nan=0.0, posinf=255.0, neginf=0.0)
    n_colour = min(3, values.shape[2])
    rgb = values[..., :n_colour]
    if values.shape[2] == 4:
        alpha = values[..., 3]
        opaque = float((alpha >= 255.0).mean())
        translucent = float(((alpha > 0.0) & (alpha < 255.0)).mean())
        alpha_mean = float(alpha.mean())
    else:
        opaque, translucent, alpha_mean = 1.0, 0.0, 255.0
    rgb_std = [float(rgb[..., i].std()) for i in range(n_colour)]
    clipped = float(((rgb <= 0.0) | (rgb >= 255.0)).mean())
    return _rounded(opaque, translucent, alpha_mean, rgb_std, banding_score(values), clipped, non_finite)


def _rounded(
    opaque: float,
    translucent: float,
    alpha_mean: float,
    rgb_std: list[float],
    banding: float,
    clipped: float,
    non_finite: bool,
) -> dict[str, Any]:
    """The structure numbers as ``structure_metrics`` reports them (either path), rounded."""
    return {
        "opaque_fraction": round(opaque, 4),
        "translucent_fraction": round(translucent, 4),
        "alpha_mean": round(alpha_mean, 1),
        "rgb_std": [round(s, 1) for s in rgb_std],
        "rgb_std_mean": round(sum(rgb_std) / len(rgb_std), 2),
        "banding_score": round(banding, 4),
        "clipped_fraction": round(clipped, 4),
        "non_finite": non_finite,
        "flat": all(s < _FLAT_STD for s in rgb_std),
    }


def _structure_metrics_uint8(array: np.ndarray) -> dict[str, Any]:
    """``structure_metrics`` of an 8-bit image in integer arithmetic: the same numbers (sums and sums of squares are
    exact), about three times faster than through float64 copies; a served 1024x1024 image is checked for collapse
    before it is returned, so this is on every request's path."""
    n = array.shape[0] * array.shape[1]
    n_colour = min(3, array.shape[2])
    rgb = array[..., :n_colour]
    if array.shape[2] == 4:
        alpha = array[..., 3]
        n_opaque, n_clear = int(np.count_nonzero(alpha == 255)), int(np.count_nonzero(alpha == 0))
        opaque, translucent = n_opaque / n, (n - n_opaque - n_clear) / n
        alpha_mean = int(alpha.sum(dtype=np.int64)) / n
    else:
        opaque, translucent, alpha_mean = 1.0, 0.0, 255.0
    rgb_std = []
    for i in range(n_colour):
        channel = rgb[..., i]
        total, squares = int(channel.sum(dtype=np.int64)), int(np.square(channel, dtype=np.int64).sum())
        # n * sum(x^2) - sum(x)^2 = n^2 * variance, exact (never negative) in Python's integers
        rgb_std.append(math.sqrt(n * squares - total * total) / n)
    clipped = int(np.count_nonzero((rgb == 0) | (rgb == 255))) / rgb.size
    return _rounded(opaque, translucent, alpha_mean, rgb_std, _banding_score_uint8(rgb), clipped, False)


def _banding_score_uint8(rgb: np.ndarray) -> float:
    """``banding_score`` over the channel sum (3x the mean: the ratio is the same) in integers."""
    if rgb.shape[0] < 2 or rgb.shape[1] < 2:
        return 0.0
    # the channel sum (at most 3 x 255 = 765) and its differences fit int16; added channel by channel: numpy's
    # reduction over a 3-long innermost axis took 35 ms of a 1024x1024 image, these adds 2.5
    luma = rgb[..., 0].astype(np.int16)
    for channel in range(1, rgb.shape[2]):
        luma += rgb[..., channel]
    rows, columns = luma.shape
    vertical = int(np.abs(np.diff(luma, axis=0)).sum(dtype=np.int64)) / ((rows - 1) * columns)
    horizontal = int(np.abs(np.diff(luma, axis=1)).sum(dtype=np.int64)) / (rows * (columns - 1))
    total = vertical + horizontal
    return 0.0 if total == 0.0 else (vertical - horizontal) / total


def structure_metrics_png(data: bytes) -> dict[str, Any]:
    return structure_metrics(load_png_array(data)[0])


def composite_over_white(array: np.ndarray) -> np.ndarray:
    """RGBA (H, W, 4) uint8 -> RGB (H, W, 3) uint8 over a white background, rounded."""
    array = _channels(array)
    if array.shape[2] != 4:
        return array[..., :3] if array.shape[2] == 3 else np.repeat(array, 3, axis=2)
    alpha = array[..., 3:4].astype(np.float64) / 255.0
    rgb = array[..., :3].astype(np.float64) * alpha + 255.0 * (1.0 - alpha)
    return np.round(rgb).clip(0, 255).astype(np.uint8)


def fidelity_arrays(a: np.ndarray, b: np.ndarray, a_mode: str, b_mode: str) -> tuple[np.ndarray, np.ndarray]:
    """The pair to compare: RGBA with RGBA when both images carry alpha, else both over white."""
    if a_mode == "RGBA" and b_mode == "RGBA":
        return a, b
    return composite_over_white(a), composite_over_white(b)


def psnr(a: np.ndarray, b: np.ndarray, peak: float = 255.0) -> float:
    """10 log10(peak^2 / MSE) over every sample; +inf for identical arrays."""
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {a.shape} vs {b.shape}")
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0.0 else 10.0 * math.log10(peak * peak / mse)


def _gaussian_kernel(size: int, sigma: float) -> np.ndarray:
    offsets = np.arange(size, dtype=np.float64) - (size - 1) / 2.0
    kernel = np.exp(-(offsets**2) / (2.0 * sigma * sigma))
    return kernel / kernel.sum()


def _filter_valid(image: np.ndarray, kernel: np.ndarray) -> np.ndarray:
    """Separable 'valid' correlation of a (H, W) image: (H, W) -> (H-k+1, W-k+1)."""
    k = kernel.size
    windows = np.lib.stride_tricks.sliding_window_view(image, k, axis=0)  # (H-k+1, W, k)
    rows = windows @ kernel
    windows = np.lib.stride_tricks.sliding_window_view(rows, k, axis=1)  # (H-k+1, W-k+1, k)
    return windows @ kernel


def ssim(a: np.ndarray, b: np.ndarray, peak: float = 255.0, window: int = 11, sigma: float = 1.5) -> float:
    """Mean SSIM (Wang et al. 2004): 11x11 gaussian window, sigma 1.5, K1 0.01, K2 0.03.

    Computed per channel over every fully-inside window position and averaged.
    Images smaller than the window use a window as large as the smaller side.
    """
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {a.shape} vs {b.shape}")
    a, b = _channels(a).astype(np.float64), _channels(b).astype(np.float64)
    size = min(window, a.shape[0], a.shape[1])
    kernel = _gaussian_kernel(size, sigma)
    c1, c2 = (0.01 * peak) ** 2, (0.03 * peak) ** 2
    scores = []
    for c in range(a.shape[2]):
        x, y = a[..., c], b[..., c]
        mu_x, mu_y = _filter_valid(x, kernel), _filter_valid(y, kernel)
        var_x = _filter_valid(x * x, kernel) - mu_x**2
        var_y = _filter_valid(y * y, kernel) - mu_y**2
        cov = _filter_valid(x * y, kernel) - mu_x * mu_y
        numerator = (2 * mu_x * mu_y + c1) * (2 * cov + c2)
        denominator = (mu_x**2 + mu_y**2 + c1) * (var_x + var_y + c2)
        scores.append(float((numerator / denominator).mean()))
    return sum(scores) / len(scores)
