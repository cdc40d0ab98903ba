"""Progress on long work: quantize and verify draw a bar (bytes or layers per second) when stderr is a
terminal, and write nothing of it to a log or CI's captured stream."""

from __future__ import annotations

import io
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import ditq
from ditq.progress import LineProgress, progress_bar


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _stderr_of(run: Callable[[], object], monkeypatch: pytest.MonkeyPatch, terminal: bool) -> str:
    stream = Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    run()
    return stream.getvalue()


def test_quantize_and_verify_draw_bars_on_a_terminal_only(
    model_dir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    source = model_dir("flux")
    drawn = _stderr_of(lambda: ditq.quantize(source, tmp_path / "a", "w8a8"), monkeypatch, terminal=True)
    assert "quantize transformer" in drawn and "B/s" in drawn
    assert (
        _stderr_of(lambda: ditq.quantize(source, tmp_path / "b", "w8a8"), monkeypatch, terminal=False) == ""
    )

    drawn = _stderr_of(lambda: ditq.verify(tmp_path / "a", source), monkeypatch, terminal=True)
    assert "verify transformer" in drawn and "layer/s" in drawn
    assert _stderr_of(lambda: ditq.verify(tmp_path / "a", source), monkeypatch, terminal=False) == ""


def test_a_bar_turned_off_stays_off_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    def count(enabled: bool) -> None:
        with progress_bar(3, "requests", "img", enabled=enabled) as bar:
            bar.update(3)

    assert "img/s" in _stderr_of(lambda: count(True), monkeypatch, terminal=True)
    assert _stderr_of(lambda: count(False), monkeypatch, terminal=True) == ""  # --no-progress


def test_generate_draws_one_bar_of_its_denoising_steps_on_a_terminal_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ditq.pipeline.generate import generate
    from ditq.runtime.adapter import GenerationRequest
    from ditq.runtime.options import LoadOptions

    request = GenerationRequest(prompt="a red circle", num_inference_steps=3, width=32, height=32, seed=0)
    drawn = _stderr_of(lambda: generate(None, request, LoadOptions(device="cpu")), monkeypatch, terminal=True)
    assert "denoising" in drawn and "/3 " in drawn and "step/s" in drawn  # a bar of the 3 steps
    assert (
        _stderr_of(lambda: generate(None, request, LoadOptions(device="cpu")), monkeypatch, terminal=False)
        == ""
    )


def test_off_a_terminal_long_work_says_a_line_with_its_eta_every_ten_seconds() -> None:
    """A log gets no bar, and nothing for quick work, but a line every 10 s of a long wait: count, rate, ETA."""
    now = [0.0]
    stream = io.StringIO()
    bar = LineProgress(8, "requests", "img", stream=stream, clock=lambda: now[0])
    for _ in range(2):  # 2 requests in 4 s: quiet
        now[0] += 2.0
        bar.update()
    assert stream.getvalue() == ""
    for _ in range(4):  # 6 requests in 12 s: one line, at 10 s
        now[0] += 2.0
        bar.update()
    bar.set_postfix(failed=0)
    bar.close()
    lines = stream.getvalue().splitlines()
    assert lines == [
        "requests: 5/8 img, 2.00 s/img, ETA 6 s",
        "requests: 6/8 img, 2.00 s/img, ETA 4 s, failed 0",
    ]
