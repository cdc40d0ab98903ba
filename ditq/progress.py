"""Progress on long work (quantize, verify, generate's steps, baseline and probe requests): a bar on a terminal,
a line at most every ``LINE_EVERY_S`` seconds elsewhere.

One constructor: on a terminal a tqdm bar (its rate and its ETA); where stderr is a log file or CI's captured stream,
a ``LineProgress``, which writes no carriage-return noise, and nothing at all for work done within
``LINE_EVERY_S`` seconds, but a line with the count, the rate and the ETA every ``LINE_EVERY_S`` seconds of longer
work, so that no long wait is silent. The probe's and baseline's ``--no-progress`` turns either off.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TextIO

from tqdm import tqdm

__all__ = ["LINE_EVERY_S", "LineProgress", "progress_bar"]

LINE_EVERY_S = 10.0


class LineProgress:
    """The part of tqdm's interface ditq uses (``update``, ``set_postfix``, ``close``, iteration, ``with``), as a
    line every ``every_s`` seconds: 'denoising: 5/20 step, 1.21 s/step, ETA 18 s'."""

    def __init__(
        self,
        total: int,
        desc: str,
        unit: str,
        iterable: Iterable[Any] | None = None,
        stream: TextIO | None = None,
        every_s: float = LINE_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total, self.desc, self.unit, self.iterable = total, desc, unit, iterable
        self.stream, self.every_s, self.clock = stream, every_s, clock
        self.n, self.postfix = 0, ""
        self.started = self.said = clock()

    def _line(self) -> str:
        elapsed = self.clock() - self.started
        done = (
            f"{self.n / 2**20:.0f}/{self.total / 2**20:.0f} MiB"
            if self.unit == "B"
            else f"{self.n}/{self.total}"
        )
        rate = f", {elapsed / self.n:.2f} s/{self.unit}" if self.n and self.unit != "B" else ""
        eta = (
            f", ETA {(self.total - self.n) * elapsed / self.n:.0f} s"
            if self.n and self.total >= self.n
            else ""
        )
        return f"{self.desc}: {done} {self.unit}{rate}{eta}{self.postfix}"

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.clock() - self.said >= self.every_s:
            self.said = self.clock()
            print(self._line(), file=self.stream or sys.stderr, flush=True)

    def set_postfix(self, refresh: bool = True, **values: Any) -> None:
        self.postfix = "".join(f", {name} {value}" for name, value in values.items())

    def close(self) -> None:
        if self.said != self.started:  # it spoke while running: say where it ended
            print(self._line(), file=self.stream or sys.stderr, flush=True)

    def __iter__(self) -> Iterator[Any]:
        for item in self.iterable or ():
            yield item
            self.update()

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def progress_bar(
    total: int, desc: str, unit: str = "B", enabled: bool = True, iterable: Iterable[Any] | None = None
) -> tqdm | LineProgress:
    """A bar of ``total`` ``unit``s (bytes are scaled to KiB/MiB/GiB per second) on a terminal, else a line every
    ``LINE_EVERY_S`` seconds; over ``iterable`` when given (it advances as the loop does); ``enabled`` False: none
    at all."""
    if enabled and not sys.stderr.isatty():
        return LineProgress(total, desc, unit, iterable)
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
