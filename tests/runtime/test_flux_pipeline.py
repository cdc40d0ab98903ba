"""A tiny FluxPipeline with CLIP and T5 text encoders, its transformer and both encoders quantized, runs end to
end in every scheme: ditq's loader, the pipeline's own call and ``ditq generate``, close to the unquantized run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import make_flux_pipeline_dir

import ditq
from ditq.pipeline.generate import generate
from ditq.pipeline.open import load_pipeline
from ditq.runtime.adapter import GenerationRequest
from ditq.runtime.options import LoadOptions

COMPONENTS = ["transformer", "text_encoder", "text_encoder_2"]
CALL = dict(num_inference_steps=2, height=32, width=32, max_sequence_length=16, guidance_scale=1.0)
# relative L2 of the packed output latents against the unquantized pipeline's, per scheme (measured 0.0004
# for w8a16, 0.0006 for w8a8 and 0.003 for fp8; each bound leaves room, none lets a broken path through)
BOUNDS = {"w8a16": 0.005, "w8a8": 0.005, "fp8": 0.02}


@pytest.fixture(scope="module")
def flux_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_flux_pipeline_dir(tmp_path_factory.mktemp("flux") / "source")


def _latents(model_dir: Path) -> torch.Tensor:
    pipeline = load_pipeline(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    return pipeline("a red kite", generator=generator, output_type="latent", **CALL).images


@pytest.mark.parametrize("scheme", sorted(BOUNDS))
def test_clip_and_t5_pipeline_runs_quantized(scheme: str, flux_source: Path, tmp_path: Path) -> None:
    out = tmp_path / scheme
    result = ditq.quantize(flux_source, out, scheme, components=COMPONENTS)
    report = ditq.verify(out, source=flux_source)
    assert report.ok, report.table()
    pipeline = load_pipeline(out, dtype=torch.float32)
    counts = {c: len(ditq.runtime.quantized_linears(pipeline.components[c])) for c in COMPONENTS}
    assert all(counts.values()), counts  # every chosen component runs quantized Linears
    assert sum(counts.values()) == result.manifest["statistics"]["quantized_tensors"]

    expected, got = _latents(flux_source), _latents(out)
    assert torch.isfinite(got).all()
    error = float(torch.linalg.vector_norm(got - expected) / torch.linalg.vector_norm(expected))
    assert 0 < error < BOUNDS[scheme], error

    request = GenerationRequest(prompt="a red kite", seed=0, num_inference_steps=2, width=32, height=32)
    image = np.asarray(generate(out, request, LoadOptions(device="cpu", dtype="float32")).result.images[0])
    assert image.shape[:2] == (32, 32) and image.std() > 0
