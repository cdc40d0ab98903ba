"""`ditq serve` on llm-compressor's checkpoints (tests/data/llmc): the doctor verifies their own layers, requests
are answered."""

from __future__ import annotations

from pathlib import Path

import pytest
from serve_testkit import FAST, client_for, make_app
from tiny_models import LLMC_SCHEMES, llmc_pipeline_dir

from ditq.pipeline.open import open_pipeline
from ditq.runtime.options import LoadOptions
from ditq.serve.startup import make_doctor


@pytest.mark.parametrize("fixture", sorted(LLMC_SCHEMES))
def test_an_llm_compressor_checkpoint_is_served(fixture: str, tmp_path: Path) -> None:
    model_dir = llmc_pipeline_dir(tmp_path / fixture, fixture)
    app = make_app(
        load=lambda: open_pipeline(model_dir, LoadOptions(device="cpu", dtype="float32")),
        doctor=make_doctor(),
    )
    with client_for(app) as client:
        health = client.get("/health").json()
        assert health["status"] == "ready" and health["doctor"]["status"] == "passed"
        assert "14 quantized layers" in health["doctor"]["summary"]
        assert set(health["kernel_paths"]) == {f"cpu-reference-{LLMC_SCHEMES[fixture]}"}
        response = client.post("/v1/images/generations", json={"prompt": "a kite", "seed": 0, **FAST})
        assert response.status_code == 200 and response.json()["size"] == "32x32"
