"""A tiny demo pipeline on disk with one edit fixture (one reference) and one text-to-image fixture."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from tiny_models import save_tiny_pipeline


def write_tiny_workspace(root: Path) -> Path:
    """``root/model`` (the tiny demo pipeline, seed 0), ``root/fixtures.json`` and ``root/refs``."""
    save_tiny_pipeline(root / "model")
    (root / "refs").mkdir()
    pixels = np.zeros((32, 32, 4), np.uint8)
    pixels[8:24, 8:24, 0], pixels[..., 3] = 220, 255
    Image.fromarray(pixels, "RGBA").save(root / "refs" / "red.png")
    common = {"width": 32, "height": 32, "negative_prompt": None}
    fixtures = {
        "edit-one": {"mode": "edit", "references": ["red"], "prompt": "make it blue", **common},
        "draw": {"mode": "generate", "references": [], "prompt": "a green circle", **common},
    }
    (root / "fixtures.json").write_text(json.dumps(fixtures))
    return root


@pytest.fixture(scope="module")
def tiny_workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_workspace(tmp_path_factory.mktemp("plan"))
