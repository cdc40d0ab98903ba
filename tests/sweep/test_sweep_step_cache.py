"""``ditq sweep --cache auto`` on the tiny model: the search keeps each scheme's last setting inside the standard.

Two settings, in order: first-block:0 (never skips: the scheme's images, unchanged) and first-block:1e9 (skips
every call a context allows: 2 of 4 steps). Under a parity band of 65 dB the tiny model's w8a8 images (about 72 dB
against the baseline) pass without a step cache and with the first setting, and fail with the second (about 58 dB),
so the search chooses first-block:0.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from tiny_models import save_tiny_pipeline

from ditq.errors import InputError
from ditq.runtime.options import LoadOptions
from ditq.sweep import SweepOptions
from ditq.sweep.run import run_sweep
from ditq.sweep.step_cache import STEP_CACHE_FILE, search_step_cache

SETTINGS = ("first-block:0", "first-block:1e9")


def _options(root: Path, **changes: object) -> SweepOptions:
    save_tiny_pipeline(root / "model")
    (root / "refs").mkdir()
    pixels = np.zeros((32, 32, 4), np.uint8)
    pixels[8:24, 8:24, 0], pixels[..., 3] = 220, 255
    Image.fromarray(pixels, "RGBA").save(root / "refs" / "ref-0.png")
    fixture = {"mode": "edit", "references": ["ref-0"], "width": 32, "height": 32, "prompt": "a red square"}
    (root / "fixtures.json").write_text(json.dumps({"edit-one": {**fixture, "negative_prompt": None}}))
    fields: dict[str, object] = {
        "model": root / "model",
        "schemes": ("w8a8",),
        "fixtures": root / "fixtures.json",
        "refs": root / "refs",
        "out": root / "out",
        "seeds": "1-2",
        "steps": 4,
        "load": LoadOptions(device="cpu", dtype="float32", cache="auto"),
        "parity_db": 65.0,
        "standard": "parity",
        "health_timeout_s": 300,
        "progress": False,
    }
    return SweepOptions(**{**fields, **changes})  # type: ignore[arg-type]


@pytest.mark.slow
def test_cache_auto_keeps_the_last_setting_inside_the_standard_and_stops_at_the_first_outside(tmp_path: Path):
    options = _options(tmp_path)
    uncached = search_step_cache(options, "ditq sweep --cache auto (test)", run_sweep, SETTINGS)
    assert uncached.verdict_json == options.out / "report" / "verdict.json"
    answer = json.loads((options.out / STEP_CACHE_FILE).read_text())["schemes"]["w8a8"]
    assert answer["chosen"] == "first-block:0" and answer["speedup"] is not None
    tried = [(row["cache"], row["passed"]) for row in answer["tried"]]
    assert tried == [(None, True), ("first-block:0", True), ("first-block:1e9", False)]
    skipped = [row["skipped_steps_per_request"] for row in answer["tried"][1:]]
    assert skipped == [{"edit-one.s1": 0, "edit-one.s2": 0}, {"edit-one.s1": 2, "edit-one.s2": 2}]
    # a setting's sweep read the first sweep's baseline and artifact, quantizing nothing; its compare rows and its
    # report say what was skipped
    setting = options.out / "cache" / "first-block-1e9"
    assert (setting / "baseline").is_symlink()
    stages = json.loads((setting / "w8a8" / "CANDIDATE.json").read_text())["stages"]
    assert stages["quantize"]["status"] == stages["verify"]["status"] == "skipped"
    assert json.loads((setting / "w8a8" / "CANDIDATE.json").read_text())["artifact"] == str(
        options.out / "w8a8" / "artifact"
    )
    rows = json.loads((setting / "w8a8" / "run" / "compare.json").read_text())["rows"]
    assert [row["skipped_steps"] for row in rows] == [2, 2]
    assert "Steps from the step cache" in (setting / "report" / "report.html").read_text()


def test_cache_auto_is_refused_beside_seeds_auto_and_a_running_server(tmp_path: Path):
    with pytest.raises(InputError, match=r"^--cache auto with --seeds auto: give the seeds"):
        _options(tmp_path, seeds="auto")
    with pytest.raises(InputError, match=r"^--cache auto with --endpoint-for: a server already running"):
        _options(tmp_path / "other", endpoint_for={"w8a8": "http://127.0.0.1:9"})
