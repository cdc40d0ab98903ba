"""`ditq plan` on another diffusers DiT: the tiny FluxPipeline (CLIP + T5, a transformer whose position ids have no
batch dimension, two kinds of block list), planned, quantized from the plan and verified end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_models import make_flux_pipeline_dir

from ditq.plan.planner import PlanOptions, make_plan


@pytest.mark.slow
def test_a_flux_pipeline_is_planned_and_verified(tmp_path: Path):
    model = make_flux_pipeline_dir(tmp_path / "model")
    (tmp_path / "refs").mkdir()
    fixture = {"mode": "generate", "references": [], "width": 32, "height": 32, "prompt": "a red square"}
    (tmp_path / "fixtures.json").write_text(json.dumps({"draw": {**fixture, "negative_prompt": None}}))
    plan = make_plan(
        PlanOptions(
            model=model,
            out=tmp_path / "PLAN.json",
            fixtures=tmp_path / "fixtures.json",
            refs=tmp_path / "refs",
            target_db=70.0,  # fp8 everywhere reaches about 59 dB: a mix is needed
            seeds="1-2",
            steps=3,
            max_rounds=2,
        )
    )
    blocks = [e.layer for e in plan.sensitivity if e.unit == "block"]
    assert blocks == ["transformer_blocks.0", "single_transformer_blocks.0"]
    assert len([e for e in plan.sensitivity if e.unit == "layer"]) == len(plan.layers) == 17
    assert set(plan.layers.values()) - {"fp8"}  # the target moved some layers off fp8
    assert plan.verification is not None and plan.verification.artifact
    assert plan.verification.meets_target == (plan.verification.psnr_db["draw"] >= 70.0)
