"""`ditq sweep --variant NAME` on a model that ships only a variant's weights: the baseline is served from those
files (and run in process for the parity pair), the candidate quantized from them, and every step of the chain
runs; without --variant the baseline server could not load the model."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from tiny_models import save_tiny_pipeline, to_variant_only

from ditq.judge.baseline import verify_seal
from ditq.runfiles import SweepFile, read_model
from ditq.runtime.options import LoadOptions
from ditq.sweep import SweepOptions, run_sweep


@pytest.mark.slow
def test_sweep_takes_a_variant_only_bf16_source_as_its_baseline(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    save_tiny_pipeline(tmp_path / "model", dtype=torch.bfloat16)
    assert to_variant_only(tmp_path / "model", "bf16") == ["text_encoder", "transformer"]
    (tmp_path / "refs").mkdir()
    pixels = np.zeros((32, 32, 4), np.uint8)
    pixels[8:24, 8:24, 0], pixels[..., 3] = 220, 255
    Image.fromarray(pixels, "RGBA").save(tmp_path / "refs" / "red.png")
    fixture = {"mode": "edit", "references": ["red"], "width": 32, "height": 32, "prompt": "a red square"}
    (tmp_path / "fixtures.json").write_text(json.dumps({"edit-one": {**fixture, "negative_prompt": None}}))
    options = SweepOptions(
        model=tmp_path / "model",
        schemes=("w8a8",),
        fixtures=tmp_path / "fixtures.json",
        refs=tmp_path / "refs",
        out=tmp_path / "out",
        seeds="1",
        steps=2,
        load=LoadOptions(device="cpu", dtype="float32", variant="bf16"),
        parity_in_process=True,  # the reference pair's second run: `ditq baseline --variant` in process
        health_timeout_s=300,
        progress=False,
    )
    with caplog.at_level(logging.WARNING, logger="ditq.sweep.run"):
        run_sweep(options, command="ditq sweep (test)")
    # one seed decides nothing: said first, and the sweep still measures what it can
    said = [r.getMessage() for r in caplog.records if r.name == "ditq.sweep.run"]
    assert said and said[0].startswith("--seeds 1: 1 seed decides no fidelity or speed answer")

    out = tmp_path / "out"
    assert read_model(SweepFile, out / "SWEEP.json").variant == "bf16"
    assert (
        verify_seal(out / "baseline") == [] and verify_seal(out / "parity-in-process") == []
    )  # sealed, intact
    records = [json.loads(line) for line in (out / "baseline" / "records.jsonl").read_text().splitlines()]
    assert [r["http"] for r in records] == [200]
    candidate = json.loads((out / "w8a8" / "CANDIDATE.json").read_text())
    stages = {name: stage["status"] for name, stage in candidate["stages"].items()}
    assert all(
        stages[s] == "ok" for s in ("quantize", "verify", "doctor", "serve", "probe", "gate", "compare")
    )
    assert "--variant bf16" in candidate["stages"]["quantize"]["command"]
    manifest = json.loads((out / "w8a8" / "artifact" / "MANIFEST.json").read_text())
    assert manifest["options"]["variant"] == "bf16"
