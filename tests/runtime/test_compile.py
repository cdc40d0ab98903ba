"""--compile: the transformer's repeated blocks compiled, the same pixels as eager, and a server that warms up every
shape it calibrates before measuring it (no measured call compiles)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tiny_models import tiny_adapter, tiny_qwen_vae
from torch._dynamo.utils import counters

import ditq
from ditq.errors import InputError
from ditq.runtime.adapter import GenerationRequest, GenerationResult, PipelineAdapter
from ditq.runtime.compile import compile_pipeline, compile_vae_decoder
from ditq.serve.cost import calibrate, calibration_shapes


def _graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


def _request(seed: int = 7) -> GenerationRequest:
    return GenerationRequest(prompt="a red circle", width=64, height=64, num_inference_steps=3, seed=seed)


def test_compiled_blocks_draw_the_same_pixels_as_eager() -> None:
    eager = tiny_adapter()
    expected = np.asarray(eager(_request()).images[0])
    compiled = tiny_adapter()
    torch._dynamo.reset()
    before = _graphs()
    facts = compile_pipeline(compiled.pipeline, "aot_eager")
    assert facts.how.startswith("repeated blocks (") and facts.module == "transformer"
    blocks = compiled.pipeline.transformer.transformer_blocks
    assert all(block._compiled_call_impl is not None for block in blocks)
    assert np.array_equal(np.asarray(compiled(_request()).images[0]), expected)
    assert _graphs() > before  # dynamo traced the blocks: the call went through compiled code


def test_a_bad_backend_or_a_pipeline_without_the_module_is_one_line() -> None:
    adapter = tiny_adapter()
    with pytest.raises(InputError, match="--compile-backend: 'tensorrt' is not one of inductor"):
        compile_pipeline(adapter.pipeline, "tensorrt")
    with pytest.raises(InputError, match="no 'unet' module to compile"):
        compile_pipeline(adapter.pipeline, "eager", component="unet")


def test_load_pipeline_compiles_on_request(tmp_path: Path) -> None:
    from ditq.demo import default_model_dir

    pipe = ditq.load_pipeline(default_model_dir(), device="cpu", compile="eager")
    assert pipe.ditq_compile.backend == "eager" and pipe.ditq_compile.warmup_seconds is None
    assert not hasattr(ditq.load_pipeline(default_model_dir(), device="cpu"), "ditq_compile")


class _Counting(PipelineAdapter):
    """The tiny pipeline, recording per call its shape and the graphs dynamo compiled during it."""

    def __init__(self) -> None:
        super().__init__(tiny_adapter().pipeline)
        self.calls: list[tuple[tuple[int, int, int], int]] = []

    def __call__(self, request: GenerationRequest) -> GenerationResult:
        before = _graphs()
        result = super().__call__(request)
        shape = (request.width or 0, request.height or 0, len(request.images))
        self.calls.append((shape, _graphs() - before))
        return result


def test_a_compiled_server_warms_up_each_shape_before_measuring_it() -> None:
    adapter = _Counting()
    torch._dynamo.reset()
    facts = compile_pipeline(adapter.pipeline, "eager")
    model = calibrate(adapter, torch.device("cpu"), max_pixels=32 * 32, time_budget_s=600)
    shapes = calibration_shapes(adapter, 32 * 32)
    assert len(model.measurements) == len(shapes)
    for shape in shapes:
        calls = [graphs for called, graphs in adapter.calls if called == shape]
        assert len(calls) == 2, shape  # warmed up, then measured
        assert calls[-1] == 0, shape  # the measured call compiled nothing
    compiled = sum(graphs for _, graphs in adapter.calls)
    # 0-4 references at three sizes: the cached step's graph and one prefix step's (tests/runtime/test_prefill.py)
    assert compiled == 2
    assert facts.warmup_seconds is not None and facts.warmup_seconds > 0
    health = facts.to_json()  # as /health shows it
    assert (health["warmup_graphs"], health["graphs_since_warmup"]) == (compiled, 0)
    adapter(
        dataclasses.replace(_request(), width=48, height=48, prompt="a size and a prompt never calibrated")
    )
    assert adapter.calls[-1][1] == 0 and facts.to_json()["graphs_since_warmup"] == 0  # dynamic shapes
    torch._dynamo.reset()  # dynamo forgets its graphs: the next request compiles, and /health counts it
    adapter(_request())
    assert facts.to_json()["graphs_since_warmup"] == adapter.calls[-1][1] > 0


def test_an_eager_server_measures_each_shape_once_after_one_warm_up() -> None:
    adapter = _Counting()
    calibrate(adapter, torch.device("cpu"), max_pixels=32 * 32, time_budget_s=600)
    shapes = calibration_shapes(adapter, 32 * 32)
    assert len(adapter.calls) == len(shapes) + 1


def test_compiled_code_is_kept_in_ditqs_cache_folder_unless_the_environment_names_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from ditq.runtime.compile import compile_cache

    monkeypatch.setenv("DITQ_CACHE_DIR", str(tmp_path / "ditq"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # what inductor sets once it has run
    assert compile_cache() == str(tmp_path / "ditq" / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))  # a user's own is kept
    assert compile_cache() == str(tmp_path / "mine")
    facts = compile_pipeline(tiny_adapter().pipeline, "eager")
    assert facts.cache == str(tmp_path / "mine")
    facts.warmed_up(1.5, graphs_at_start=0)
    shown = facts.to_json()
    assert shown["cache_hits"] == 0 and shown["cache_misses"] == 0 and "_cache_at_start" not in shown


def _pixels(decoded: torch.Tensor) -> torch.Tensor:
    """(B, C, 1, H, W) in [-1, 1] -> 0..255 levels, as the pipeline's postprocess rounds them."""
    return ((decoded[:, :, 0].float() / 2 + 0.5).clamp(0, 1) * 255).round()


def test_the_compiled_decoder_draws_the_untouched_decodes_pixels_within_one_level() -> None:
    """The served decode (``compile_vae_decoder``, traced as a server traces it; aot_eager here, since inductor's
    code generation for the CPU took three of the suite's minutes) against the untouched one in float32 at two
    latent sizes: at most one level of 255 apart anywhere, at most 0.01 level on average, one graph for both sizes.
    (Inductor's code, in BF16 on an H100: at most 4 levels, 0.59 on average, benchmarks/decode_answer_bench.py; the
    GPU test of the tiny pipeline compiled with inductor draws within its band.)"""
    untouched, served = tiny_qwen_vae(), tiny_qwen_vae()
    torch._dynamo.reset()
    before = _graphs()
    assert compile_vae_decoder(served, "aot_eager") == "decoder (QwenImage21Decoder3d)"
    for seed, (height, width) in ((1, (8, 8)), (2, (6, 10))):
        latents = torch.randn(1, 16, 1, height, width, generator=torch.Generator().manual_seed(seed))
        with torch.inference_mode():
            expected, got = _pixels(untouched.decode(latents).sample), _pixels(served.decode(latents).sample)
        assert got.shape == expected.shape == (1, 4, 16 * height, 16 * width)
        difference = (got - expected).abs()
        assert difference.max().item() <= 1.0 and difference.mean().item() <= 0.01
        assert expected.std().item() > 0  # not a flat image: the comparison sees structure
    assert _graphs() - before == 1  # traced once, with dynamic sizes: the second size compiled nothing


def test_a_vae_without_a_decoder_module_stays_as_it_is() -> None:
    assert compile_vae_decoder(None, "aot_eager") is None
    assert compile_vae_decoder(torch.nn.Linear(2, 2), "aot_eager") is None


def test_a_pipeline_placed_by_offload_auto_keeps_its_vae_decoder_eager() -> None:
    """Under --offload auto the VAE may stream through hooks that move its weights: its decoder is not compiled."""
    placed = SimpleNamespace(transformer=torch.nn.Linear(2, 2), vae=tiny_qwen_vae(), ditq_placement=object())
    assert compile_pipeline(placed, "eager").module == "transformer"
    assert placed.vae.decoder._compiled_call_impl is None
    whole = SimpleNamespace(transformer=torch.nn.Linear(2, 2), vae=tiny_qwen_vae())
    assert compile_pipeline(whole, "eager").module == "transformer, vae"
    assert whole.vae.decoder._compiled_call_impl is not None
