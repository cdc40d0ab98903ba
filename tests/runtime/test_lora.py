"""LoRA adapters on ditq's quantized Linears, loaded by diffusers' own calls: a seeded adapter made with peft on the
tiny demo pipeline in source precision, loaded onto its quantized artifacts (``ditq.load_pipeline`` and diffusers'
``from_pretrained`` after ``import ditq.diffusers``); the adapted images follow the source's adapted images, the
adapter unloads to the very layers that were there, and merging is refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from lora_kit import add_seeded_adapter

import ditq
from ditq.demo import load_demo_pipeline
from ditq.errors import InputError
from ditq.metrics import psnr
from ditq.runtime.modules import QuantizedLinear

pytest.importorskip("peft")  # installed by `make test` (the test extra); ditq[lora] for users


def _image(pipeline: object) -> np.ndarray:
    generator = torch.Generator().manual_seed(1)
    out = pipeline(prompt="a red circle", num_inference_steps=3, width=64, height=64, generator=generator)  # type: ignore[operator]
    return np.asarray(out.images[0]).astype(np.float64)


@pytest.fixture(scope="module")
def adapter(demo_artifacts: dict[str, Path]) -> tuple[dict[str, torch.Tensor], np.ndarray, np.ndarray]:
    """(the adapter's state dict, the source's image with it, the source's image without it)."""
    source = load_demo_pipeline(demo_artifacts["source"])
    state = add_seeded_adapter(source.transformer)  # an adapter that visibly changes the image
    adapted = _image(source)
    source.transformer.disable_adapters()
    return state, adapted, _image(source)


@pytest.mark.parametrize("scheme", ["fp8", "w8a8", "w4a16"])
def test_an_adapter_on_a_quantized_pipeline_follows_the_source_with_it(
    demo_artifacts: dict[str, Path],
    adapter: tuple[dict[str, torch.Tensor], np.ndarray, np.ndarray],
    scheme: str,
) -> None:
    state, source_adapted, source_plain = adapter
    assert psnr(source_adapted, source_plain) < 30  # the adapter changes the image
    pipeline = ditq.load_pipeline(demo_artifacts[scheme], device="cpu")
    plain = _image(pipeline)
    before = {n: m for n, m in pipeline.transformer.named_modules() if isinstance(m, QuantizedLinear)}

    pipeline.transformer.load_lora_adapter(state, adapter_name="style", prefix=None)
    wrapped = pipeline.transformer.get_submodule("transformer_blocks.0.attn.to_q")
    assert (
        type(wrapped).__name__ == "QuantizedLoraLinear"
        and wrapped.get_base_layer() is before["transformer_blocks.0.attn.to_q"]
    )
    adapted = _image(pipeline)
    # close to the adapted source (the gate's visually lossless PSNR, 40 dB), and far from its own image without
    # the adapter: the adapter's change is reproduced, not lost beside the quantized GEMM
    assert psnr(adapted, source_adapted) >= 40.0
    assert psnr(adapted, source_adapted) > psnr(adapted, plain) + 15.0

    with pytest.raises(InputError, match="merging into the stored weights is refused"):
        pipeline.transformer.fuse_lora()
    pipeline.transformer.unload_lora()
    after = {n: m for n, m in pipeline.transformer.named_modules() if isinstance(m, QuantizedLinear)}
    assert after.keys() == before.keys() and all(after[n] is before[n] for n in before)
    assert np.array_equal(_image(pipeline), plain)


def test_diffusers_from_pretrained_takes_the_adapter_too(
    demo_artifacts: dict[str, Path], adapter: tuple[dict[str, torch.Tensor], np.ndarray, np.ndarray]
) -> None:
    from diffusers import DiffusionPipeline

    import ditq.diffusers

    state, _, _ = adapter
    theirs = DiffusionPipeline.from_pretrained(demo_artifacts["fp8"])
    ours = ditq.load_pipeline(demo_artifacts["fp8"], device="cpu")
    for pipeline in (theirs, ours):
        pipeline.transformer.load_lora_adapter(state, adapter_name="style", prefix=None)
    assert np.array_equal(_image(theirs), _image(ours))
