"""The sweep's progress display: a total fixed at the start, lines beyond the stages never moving it."""

from __future__ import annotations

import io

from ditq.sweep.core import Progress


def test_the_total_is_fixed_and_extra_lines_do_not_count() -> None:
    stream = io.StringIO()
    progress = Progress(
        [("BF16", "baseline"), ("w8a8", "serve"), ("w8a8", "probe"), ("all", "report")], True, stream
    )
    progress("BF16", "baseline", "running")
    progress("baseline", "serve", "ok", "offload none")  # a server's start: shown, not a stage
    progress("BF16", "baseline", "ok")
    progress("w8a8", "serve", "out of memory", "offload none")  # a rung of the ladder
    progress("w8a8", "serve", "ok", "offload model")  # the stage itself, already counted once
    progress.ticker("w8a8", "probe", lambda: "3/8 requests, 2.0 s each, ETA 10 s")()
    progress("w8a8", "probe", "ok")
    progress("all", "seeds", "ok", "edit-one: seeds 1-6")  # --seeds auto: shown, not a stage
    progress("all", "report", "ok")
    counts = [line.split("]")[0] for line in stream.getvalue().splitlines()]
    assert counts == ["[ 0/4", "[ 0/4", "[ 1/4", "[ 2/4", "[ 2/4", "[ 2/4", "[ 3/4", "[ 3/4", "[ 4/4"]
    assert "probe     running: 3/8 requests, 2.0 s each, ETA 10 s" in stream.getvalue()
