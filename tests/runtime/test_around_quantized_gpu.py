"""What users put around a quantized model, on a GPU: a LoRA adapter on the demo's quantized artifacts (fp8, w4a8,
w4a16 with a low-rank branch) loaded onto CUDA, diffusers' step cache on a CUDA pipeline, and the 4-bit schemes'
int8 token embedding looked up on CUDA. The CPU tests (test_lora.py, test_step_cache.py, test_embedding.py) hold
the same properties on the CPU; these run the CUDA kernels under them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

import ditq
from ditq.checkpoint.codecs import codec_for
from ditq.demo import load_demo_pipeline
from ditq.metrics import psnr
from ditq.numerics import quantize_weight
from ditq.runtime.adapter import GenerationRequest, PipelineAdapter
from ditq.runtime.embedding import embedding_from_stored
from ditq.runtime.modules import QuantizedLinear
from ditq.runtime.step_cache import install_step_cache
from ditq.schemes import get_scheme

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
STEPS = 6


def _image(pipeline: object, side: int = 64) -> np.ndarray:
    generator = torch.Generator().manual_seed(1)
    out = pipeline(prompt="a red circle", num_inference_steps=3, width=side, height=side, generator=generator)  # type: ignore[operator]
    return np.asarray(out.images[0]).astype(np.float64)


@pytest.fixture(scope="module")
def adapted_source(demo_artifacts: dict[str, Path]) -> tuple[dict[str, torch.Tensor], np.ndarray]:
    """(a seeded adapter's state dict, the source pipeline's image with it, on the CPU)."""
    pytest.importorskip("peft")
    from lora_kit import add_seeded_adapter

    source = load_demo_pipeline(demo_artifacts["source"])
    state = add_seeded_adapter(source.transformer)
    return state, _image(source)


@pytest.fixture(scope="module")
def low_rank_artifact(demo_artifacts: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("low-rank") / "w4a16-r8"
    return ditq.quantize(demo_artifacts["source"], out, "w4a16", low_rank=8).path


@pytest.mark.parametrize("scheme", ["fp8", "w4a8", "w4a16-low-rank"])
def test_an_adapter_on_a_cuda_quantized_pipeline_follows_the_source_with_it(
    demo_artifacts: dict[str, Path],
    low_rank_artifact: Path,
    adapted_source: tuple[dict[str, torch.Tensor], np.ndarray],
    scheme: str,
) -> None:
    state, source_adapted = adapted_source
    artifact = low_rank_artifact if scheme == "w4a16-low-rank" else demo_artifacts[scheme]
    pipeline = ditq.load_pipeline(artifact, device="cuda")
    layers = {n: m for n, m in pipeline.transformer.named_modules() if isinstance(m, QuantizedLinear)}
    plain = _image(pipeline)
    assert layers and all(m.kernel is not None and m.kernel.device_type == "cuda" for m in layers.values())
    pipeline.transformer.load_lora_adapter(state, adapter_name="style", prefix=None)
    adapted = _image(pipeline)
    # the adapter's change is reproduced beside the CUDA GEMMs: near the adapted source, far from the plain image
    assert psnr(adapted, source_adapted) > psnr(adapted, plain) + 15.0
    assert psnr(adapted, source_adapted) >= 30.0
    pipeline.transformer.unload_lora()
    after = {n: m for n, m in pipeline.transformer.named_modules() if isinstance(m, QuantizedLinear)}
    assert after.keys() == layers.keys() and all(after[n] is layers[n] for n in layers)
    assert np.array_equal(_image(pipeline), plain)


def _request() -> GenerationRequest:
    references = [Image.new("RGBA", (32, 32), (200, 40 * i, 30, 255)) for i in range(2)]
    return GenerationRequest(
        prompt="a red square", images=references, width=32, height=32, num_inference_steps=STEPS, seed=3
    )  # type: ignore[arg-type]


@pytest.mark.parametrize("scheme", ["fp8", "w4a8"])
def test_the_step_cache_skips_on_a_cuda_pipeline_and_threshold_zero_changes_no_pixel(
    demo_artifacts: dict[str, Path], scheme: str
) -> None:
    adapter = PipelineAdapter(ditq.load_pipeline(demo_artifacts[scheme], device="cuda"))
    reference = np.asarray(adapter(_request()).images[0], dtype=np.int16)
    run = install_step_cache(adapter.pipeline, "first-block:0")
    result = adapter(_request())
    assert result.skipped_steps == 0
    assert np.array_equal(np.asarray(result.images[0], dtype=np.int16), reference)
    run.remove()
    run = install_step_cache(adapter.pipeline, "first-block:1e9")
    result = adapter(_request())
    assert run.calls == [False, False] + [True] * (STEPS - 2) and result.skipped_steps == STEPS - 2
    assert np.abs(np.asarray(result.images[0], dtype=np.int16) - reference).max() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_int8_token_embedding_looks_up_on_cuda_what_the_codec_decodes(dtype: torch.dtype) -> None:
    scheme = get_scheme("w8a16")
    table = (
        torch.randn(512, 256, generator=torch.Generator().manual_seed(0))
        * torch.linspace(0.01, 3, 512)[:, None]
    )
    stored = codec_for(scheme).encode(*quantize_weight(table, scheme))
    module = embedding_from_stored(stored, scheme, dtype).to("cuda")
    reference = codec_for(scheme).decode(stored, dtype)
    ids = torch.randint(0, 512, (4, 33), generator=torch.Generator().manual_seed(1))
    out = module(ids.to("cuda"))
    assert out.device.type == "cuda" and torch.equal(out.cpu(), reference[ids])


@pytest.mark.parametrize("scheme", ["fp8", "w4a8"])
def test_generate_with_adapters_on_cuda_draws_what_the_python_pipeline_draws(
    demo_artifacts: dict[str, Path],
    lora_files: dict[str, Path],
    tmp_path: Path,
    scheme: str,
) -> None:
    """``ditq generate --lora`` on CUDA (the doctor choosing each layer's kernel) against ditq's Python pipeline on
    CUDA with the same adapters loaded by diffusers' own calls."""
    import warnings

    from ditq.cli import main

    pipeline = ditq.load_pipeline(demo_artifacts[scheme], device="cuda")
    plain = _image(pipeline, 32)
    pipeline.transformer.load_lora_adapter(str(lora_files["peft"]), adapter_name="style", prefix=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        pipeline.transformer.load_lora_adapter(
            str(lora_files["diffusers"]), weight_name="pytorch_lora_weights.safetensors", adapter_name="bold"
        )
    pipeline.transformer.set_adapters(["style", "bold"], [1.0, 0.5])
    adapted = _image(pipeline, 32)
    out = tmp_path / "out.png"
    argv = [
        "generate",
        str(demo_artifacts[scheme]),
        "--prompt",
        "a red circle",
        "--seed",
        "1",
        "--steps",
        "3",
    ]
    argv += ["--size", "32x32", "--device", "cuda", "--on-collapse", "warn", "--out", str(out)]
    argv += ["--lora", f"style={lora_files['peft']}", "--lora", f"bold={lora_files['diffusers']}:0.5"]
    assert main(argv) == 0
    with Image.open(out) as image:
        generated = np.asarray(image)
    assert not np.array_equal(generated, plain)
    assert psnr(generated.astype(np.float64), adapted.astype(np.float64)) >= 40.0


@pytest.mark.parametrize("setting", ["first-block:1e9", "taylorseer:2:1"])
@pytest.mark.parametrize("offload", ["block", "auto"])
def test_a_streamed_cuda_transformer_skips_the_steps_a_resident_one_skips_and_draws_its_image(
    demo_artifacts: dict[str, Path], offload: str, setting: str
) -> None:
    """diffusers' group offload on CUDA (blocks prefetched on a side stream) under the step cache: the calls served
    from the cache and the image are the resident cached run's (``auto`` under a budget nothing fits)."""
    from ditq.pipeline.open import open_pipeline
    from ditq.runtime.options import LoadOptions

    def opened(offload: str, **options: object) -> Any:
        return open_pipeline(
            demo_artifacts["fp8"],
            LoadOptions(device="cuda", offload=offload, cache=setting, skip_doctor=True, **options),  # type: ignore[arg-type]
        )

    def drawn(adapter: Any) -> tuple[np.ndarray, list[bool]]:
        image = np.asarray(adapter(_request()).images[0], dtype=np.int16)
        return image, list(adapter.pipeline.ditq_step_cache.calls)

    if offload == "auto":
        # everything streams, the text encoder too, which costs it torch's fused path: the reference is the
        # resident transformer beside the same streamed text encoder (as tests/runtime/test_step_cache.py's)
        reference = opened("auto")
        placement = reference.pipeline.ditq_placement
        assert placement.demote(reference.pipeline) == "text_encoder streams from pinned host memory"
        resident, resident_calls = drawn(reference)
        streamed = opened("auto", memory_budget_bytes=1)
        assert streamed.pipeline.ditq_placement.streamed == ["transformer", "text_encoder"]
    else:
        resident, resident_calls = drawn(opened("none"))
        streamed = opened(offload)
    image, calls = drawn(streamed)
    # a second request: the first call of the first one ended diffusers' lazy prefetch (streams), which cuts the
    # block cache's hooks out of their chain; mended, both requests skip what the resident transformer skips
    again, calls_again = drawn(streamed)
    assert sum(calls) > 0 and calls == resident_calls and calls_again == resident_calls
    assert np.abs(image - resident).max() <= 1 and np.array_equal(again, image)


@pytest.mark.parametrize("scheme", ["fp8", "w4a8"])
def test_a_streamed_cuda_transformer_leaves_none_of_its_quantized_weights_on_the_device(
    demo_artifacts: dict[str, Path], scheme: str
) -> None:
    """After its calls, a streamed quantized transformer holds nothing on the device: its quantized Linears keep
    their weights in buffers, which diffusers 0.42's stream offload left there (huggingface/diffusers#13238;
    ``ditq.runtime.diffusers_hooks.mend_offload_group``)."""
    from ditq.pipeline.open import open_pipeline
    from ditq.runtime.options import LoadOptions

    adapter = open_pipeline(
        demo_artifacts[scheme],
        LoadOptions(device="cuda", offload="auto", memory_budget_bytes=1, skip_doctor=True),
    )
    assert "transformer" in adapter.pipeline.ditq_placement.streamed
    transformer = adapter.pipeline.transformer
    assert any(isinstance(m, QuantizedLinear) for m in transformer.modules())
    for _ in range(
        2
    ):  # the first call records the blocks' order (diffusers' lazy prefetch), the second prefetches
        adapter(_request())
        torch.cuda.synchronize()
        left = [
            name for name, t in (*transformer.named_parameters(), *transformer.named_buffers()) if t.is_cuda
        ]
        assert left == [], f"left on the device after a call: {left[:5]} ({len(left)} tensors)"
