"""Progress bars for long work (quantize, verify, baseline and probe requests): drawn on a terminal, silent in
logs and CI.

One constructor over tqdm: a bar is drawn only when its stream (stderr) is a terminal (tqdm's
``disable=None``), so a log file or a CI job gets no carriage-return noise; the probe's and baseline's
``--no-progress`` turns theirs off on a terminal too.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tqdm import tqdm

__all__ = ["progress_bar"]


def progress_bar(
    total: int, desc: str, unit: str = "B", enabled: bool = True, iterable: Iterable[Any] | None = None
) -> tqdm:
    """A bar of ``total`` ``unit``s (bytes are scaled to KiB/MiB/GiB per second), over ``iterable`` when given
    (it advances as the loop does); ``enabled`` False: none at all."""
    return tqdm(
        iterable,
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=unit == "B",
        unit_divisor=1024 if unit == "B" else 1000,
        disable=None if enabled else True,
        dynamic_ncols=True,
        leave=False,
    )
