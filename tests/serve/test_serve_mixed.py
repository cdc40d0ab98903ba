"""`ditq serve` on a mixed-precision artifact (``quantize --plan``): the doctor verifies a kernel path per layer's
scheme, /health says which schemes each component holds and which paths run them, requests are answered."""

from __future__ import annotations

from pathlib import Path

from serve_testkit import FAST, client_for, make_app
from tiny_models import llmc_pipeline_dir, plan_file

import ditq
from ditq.pipeline.open import open_pipeline
from ditq.runtime.options import LoadOptions
from ditq.serve.startup import make_doctor


def _mixed_pipeline(tmp_path: Path) -> Path:
    """The tiny demo pipeline whose transformer's block Linears take fp8, w8a8 and w8a16 in turn (one kept)."""
    source = llmc_pipeline_dir(tmp_path / "source", "source")
    plannable = ditq.quantize(source, tmp_path / "probe", "w8a8").manifest["components"]["transformer"][
        "quantized"
    ]
    layers = {name: ("fp8", "w8a8", "w8a16", "keep")[i % 4] for i, name in enumerate(plannable)}
    ditq.quantize(source, tmp_path / "mixed", plan=plan_file(source, layers))
    return tmp_path / "mixed"


def test_a_mixed_artifact_is_served(tmp_path: Path) -> None:
    model_dir = _mixed_pipeline(tmp_path)
    app = make_app(
        load=lambda: open_pipeline(model_dir, LoadOptions(device="cpu", dtype="float32")),
        doctor=make_doctor(),
    )
    with client_for(app) as client:
        health = client.get("/health").json()
        assert health["status"] == "ready" and health["doctor"]["status"] == "passed"
        counts = health["quantized"]["transformer"]
        assert set(counts) == {"fp8", "w8a8", "w8a16"} and sum(counts.values()) == 11  # 14 plannable, 3 kept
        assert health["kernel_paths"] == {f"cpu-reference-{scheme}": n for scheme, n in counts.items()}
        response = client.post("/v1/images/generations", json={"prompt": "a kite", "seed": 0, **FAST})
        assert response.status_code == 200 and response.json()["size"] == "32x32"
