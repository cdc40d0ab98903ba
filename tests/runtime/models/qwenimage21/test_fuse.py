"""Fused projections: query/key/value and gate/up of every Qwen-Image-2.1 block run as one quantized GEMM each,
with the same output as the separate layers, under diffusers' own forward code, eager and traced."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21Attention

import ditq
from ditq.checkpoint.codecs import codec_for
from ditq.demo import default_model_dir
from ditq.numerics import quantize_weight
from ditq.runtime.adapter import GenerationRequest, PipelineAdapter
from ditq.runtime.loader import pipeline_summary
from ditq.runtime.models.qwenimage21.fuse import FusedQKVAttnProcessor, FusedSwiGLUFeedForward
from ditq.runtime.modules import fuse_linears, linear_from_stored
from ditq.schemes import get_scheme


def _layer(
    scheme_name: str, out_features: int, in_features: int, seed: int
) -> ditq.runtime.modules.QuantizedLinear:
    scheme = get_scheme(scheme_name)
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator)
    q, scale = quantize_weight(weight, scheme)
    return linear_from_stored(codec_for(scheme).encode(q, scale), scheme, None)


@pytest.mark.parametrize("scheme", ["w8a8", "fp8", "w8a16"])
def test_a_fused_linear_computes_its_members_side_by_side(scheme: str) -> None:
    members = [_layer(scheme, out, 64, seed) for seed, out in enumerate((32, 32, 48))]
    fused = fuse_linears(dict(zip("abc", members, strict=True)))
    assert (fused.out_features, fused.in_features) == (112, 64)
    assert fused.fused_members == (("a", 32), ("b", 32), ("c", 48))
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(9))
    expected = torch.cat([m(x) for m in members], dim=-1)
    torch.testing.assert_close(fused(x), expected, rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def w8a8_demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fuse") / "w8a8"
    ditq.quantize(default_model_dir(), out, "w8a8")
    return out


def _image(pipe: object) -> np.ndarray:
    request = GenerationRequest(prompt="a red circle", width=64, height=64, num_inference_steps=3, seed=7)
    return np.asarray(PipelineAdapter(pipe)(request).images[0], dtype=np.int16)


def test_the_loader_fuses_every_block_and_draws_what_the_separate_layers_draw(w8a8_demo: Path) -> None:
    separate = ditq.load_pipeline(w8a8_demo, device="cpu")
    fused = ditq.load_pipeline(w8a8_demo, device="cpu", fuse=True)
    attentions = [m for m in fused.transformer.modules() if isinstance(m, QwenImage21Attention)]
    assert attentions and all(
        isinstance(a.processor, FusedQKVAttnProcessor) and not hasattr(a, "to_q") for a in attentions
    )
    blocks = fused.transformer.transformer_blocks
    assert all(isinstance(block.img_mlp, FusedSwiGLUFeedForward) for block in blocks)
    # the summary counts the checkpoint's Linears either way
    assert pipeline_summary(fused) == pipeline_summary(separate)
    assert np.array_equal(_image(fused), _image(separate))


def test_fused_blocks_trace_as_one_graph(w8a8_demo: Path) -> None:
    pipe = ditq.load_pipeline(w8a8_demo, device="cpu", fuse=True)
    block = pipe.transformer.transformer_blocks[0]
    eager = _image(pipe)
    torch._dynamo.reset()
    block.compile(backend="eager", fullgraph=True)  # a graph break would raise here
    assert np.array_equal(_image(pipe), eager)
