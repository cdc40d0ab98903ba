"""`ditq serve --attention` and `ditq sweep --attention`: the server installs the doctor-chosen quantized-attention
path before it is ready and says which in /health (read back typed as RUN.json reads it); the sweep gives the
option to the candidates' servers and not to the baseline's."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
from PIL import Image
from serve_testkit import FAST, client_for, make_app

from ditq.demo import default_model_dir
from ditq.pipeline.open import open_pipeline
from ditq.runfiles import ServerHealth
from ditq.runtime.options import LoadOptions
from ditq.serve.startup import make_doctor
from ditq.sweep import SweepOptions, default_serve_argv


def _serve_one(attention: str | None) -> tuple[dict, np.ndarray]:  # type: ignore[type-arg]
    model_dir = default_model_dir()
    app = make_app(
        load=lambda: open_pipeline(
            model_dir, LoadOptions(device="cpu", dtype="float32", attention=attention)
        ),
        doctor=make_doctor(),
    )
    with client_for(app) as client:
        health = client.get("/health").json()
        response = client.post("/v1/images/generations", json={"prompt": "a red kite", "seed": 3, **FAST})
        assert response.status_code == 200, response.text
    png = base64.b64decode(response.json()["data"][0]["b64_json"])
    return health, np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.float64)


def test_serve_runs_the_chosen_quantized_attention_and_says_so() -> None:
    health, image = _serve_one("int8")
    assert health["status"] == "ready"
    assert health["attention"].startswith("cpu-reference-attention-int8 (int8 Q.K^T)")
    assert ServerHealth.model_validate(health).attention == health["attention"]
    stock_health, stock = _serve_one(None)
    assert "attention" not in stock_health and ServerHealth.model_validate(stock_health).attention is None
    # the same request through int8 attention: a different image, within a few 8-bit levels of the stock one
    difference = np.abs(image - stock)
    assert difference.max() > 0
    psnr = 10 * np.log10(255.0**2 / np.mean(difference**2))
    assert psnr > 30.0, psnr


def test_serve_attention_auto_says_what_it_timed_and_serves_that_way() -> None:
    """--attention auto times the doctor's int8 path against the model's own attention at start-up, then int8-fp8's
    and then fp8-fp8's where the one before was not faster, and says each in /health; the server then draws as the
    path it kept (stock attention: the stock image, bit for bit)."""
    health, image = _serve_one("auto")
    summary = health["attention"]
    assert health["status"] == "ready" and summary.startswith("auto: ")
    # both served shapes, timed both ways, for each kind tried: those not faster, and the one kept if any
    kept = 0 if summary.startswith("auto: the model's own attention") else 1
    tried = summary.count(" not faster: ") + kept
    assert 1 <= tried <= 3 and summary.count("vs SDPA") == 2 * tried, summary
    assert kept or tried == 3  # the model's own attention only once every kind was slower
    _, stock = _serve_one(None)
    if summary.startswith("auto: the model's own attention"):
        assert np.array_equal(image, stock)
    else:
        assert summary.startswith("auto: cpu-reference-attention-int8") and not np.array_equal(image, stock)


def test_the_sweep_gives_attention_to_the_candidates_only(tmp_path: Path) -> None:
    model = default_model_dir()
    options = SweepOptions(
        model=model,
        schemes=("w8a8",),
        fixtures=model.parent / "fixtures.json",
        refs=model.parent / "references",
        out=tmp_path / "out",
        load=LoadOptions(device="cpu", attention="fp8"),
    )
    baseline = default_serve_argv(model, 8000, options)
    candidate = default_serve_argv(tmp_path / "out" / "w8a8" / "artifact", 8001, options)
    assert "--attention" not in baseline
    assert candidate[candidate.index("--attention") + 1] == "fp8"
