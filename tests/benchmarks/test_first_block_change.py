"""benchmarks/first_block_change.py: the number it records at each step is the one diffusers' First Block Cache
thresholds, so a threshold just under its smallest skips nothing and one just over the first skips that step."""

from __future__ import annotations

import sys
from pathlib import Path

from PIL import Image
from tiny_models import tiny_adapter

from ditq.runtime.adapter import GenerationRequest
from ditq.runtime.step_cache import install_step_cache

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from first_block_change import FirstBlockWatch

STEPS = 6


def _request() -> GenerationRequest:
    references = [Image.new("RGBA", (32, 32), (200, 40, 30, 255))]
    return GenerationRequest(
        prompt="a red square", images=references, width=32, height=32, num_inference_steps=STEPS, seed=3
    )  # type: ignore[arg-type]


def test_the_watched_change_is_what_first_block_cache_thresholds() -> None:
    adapter = tiny_adapter()
    watch = FirstBlockWatch(adapter.pipeline.transformer)
    changes = watch.begin()
    adapter(_request())
    assert len(changes) >= 2 and all(c > 0 for c in changes)  # the extract call left out
    for handle in watch.handles:
        handle.remove()

    below = tiny_adapter()
    install_step_cache(below.pipeline, f"first-block:{min(changes) * 0.999}")
    assert below(_request()).skipped_steps == 0
    over_first = tiny_adapter()
    run = install_step_cache(over_first.pipeline, f"first-block:{changes[0] * 1.001}")
    over_first(_request())
    assert run.calls[:3] == [
        False,
        False,
        True,
    ]  # the extract call, the first denoising call, the second skipped
