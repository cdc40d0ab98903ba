"""The answer of one request (collapse check, PNG, JSON) overlaps the next request's generation, live on loopback,
and the check beside the PNG gives what the two give one after the other."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image
from serve_testkit import FAST, LiveServer, make_app, tiny_adapter

from ditq.runtime import images
from ditq.runtime.adapter import GenerationRequest, GenerationResult
from ditq.signatures import load_rules

ENCODE_S = 1.0  # each answer's encoding held this long: longer than a FAST generation's wait in the queue


class TimedAdapter:
    """The tiny pipeline's adapter, recording when each generation began."""

    def __init__(self) -> None:
        self.adapter = tiny_adapter()
        self.started: list[float] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.adapter, name)

    def __call__(self, request: GenerationRequest) -> GenerationResult:
        self.started.append(time.perf_counter())
        return self.adapter(request)


def test_the_next_generation_starts_while_the_last_answer_is_encoded(monkeypatch: pytest.MonkeyPatch) -> None:
    timed = TimedAdapter()
    encoded: list[tuple[float, float]] = []  # (start, end) of each answer's encoding
    real_encode = images.encode_image

    def slow_encode(*args: Any, **kwargs: Any) -> bytes:
        start = time.perf_counter()
        time.sleep(ENCODE_S)
        data = real_encode(*args, **kwargs)
        encoded.append((start, time.perf_counter()))
        return data

    monkeypatch.setattr(images, "encode_image", slow_encode)
    app = make_app(load=lambda: timed)
    with LiveServer(app) as live:
        assert app.state.serve.wait_loaded(120)
        url = f"{live.base_url}/v1/images/generations"
        statuses: list[int] = []

        def post(prompt: str) -> None:
            statuses.append(httpx.post(url, json={"prompt": prompt, **FAST}, timeout=60).status_code)

        first = threading.Thread(target=post, args=("first",))
        first.start()
        while not timed.started:  # the first is generating: the second waits in the queue
            time.sleep(0.01)
        second = threading.Thread(target=post, args=("second",))
        second.start()
        first.join(60)
        second.join(60)
    assert statuses == [200, 200]
    assert len(timed.started) == 2 and len(encoded) == 2
    first_answer_end = min(encoded)[1]
    # the worker took the second request while the first's answer was still being encoded (in the worker's thread,
    # the second generation would begin only after it)
    assert timed.started[0] < timed.started[1] < first_answer_end


def test_the_check_beside_the_png_gives_what_each_gives_alone() -> None:
    rng = np.random.default_rng(2301)
    pictures = [
        Image.fromarray(
            rng.integers(0, 256, (48, 40, 4), dtype=np.uint8)
        ),  # noise, half transparent: collapsed
        Image.new("RGB", (40, 24), (200, 30, 30)),  # flat: collapsed
        Image.fromarray(rng.integers(0, 256, (24, 40, 3), dtype=np.uint8)),  # noise, opaque: sound
    ]
    rules = load_rules()
    reasons, encoded = images.checked_and_encoded(pictures, rules, "png", "auto")
    assert reasons == [images.collapse_reasons(p, rules) for p in pictures]
    assert reasons[0] and reasons[1] and not reasons[2]
    assert encoded == [images.encode_image(p, "png", "auto") for p in pictures]
