"""Quantized attention installed on a tiny demo pipeline: the processor routes every attention call of the
block-causal prefill and of the cached decode (an exact float path reproduces the stock processor), the int8 and
fp8 reference paths give a finite image close to the plain one, and ``ditq generate --attention`` reaches it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from ditq.cli import main
from ditq.demo import build_tiny_pipeline
from ditq.doctor.attention import attention_chooser
from ditq.errors import InputError
from ditq.kernels.attention import (
    QuantizedQK,
    register_attention_kernel,
    unregister_attention_kernel,
)
from ditq.kernels.attention.reference import allowed_keys
from ditq.numerics import relative_l2
from ditq.runtime.attention import install_attention
from ditq.runtime.models.qwenimage21.attention import QuantizedAttnProcessor


def _float_qk(query: torch.Tensor, key: torch.Tensor, kind: str) -> QuantizedQK:
    """No quantization at all: the values themselves with unit scales."""
    ones = query.new_ones(*query.shape[:3], 1, dtype=torch.float32)
    return QuantizedQK(kind, query, ones, key, key.new_ones(*key.shape[:3], 1, dtype=torch.float32))


def _float_sdpa(qk: QuantizedQK, value, key_valid, causal_offset, sm_scale) -> torch.Tensor:  # type: ignore[no-untyped-def]
    mask = allowed_keys(key_valid, causal_offset, range(qk.query.shape[1]), qk.key.shape[1], value.device)
    q, k, v = (x.transpose(1, 2) for x in (qk.query, qk.key, value))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=sm_scale).transpose(1, 2)


@pytest.fixture
def exact_path() -> Iterator[str]:
    register_attention_kernel(name="test-exact-attention", kind="int8", device_type="cpu", priority=500,
                              quantize=_float_qk)(_float_sdpa)  # fmt: skip
    yield "test-exact-attention"
    unregister_attention_kernel("test-exact-attention")


def _sprite(color: tuple[int, int, int]) -> Image.Image:
    image = Image.new("RGBA", (32, 32), (0, 0, 0, 0))
    image.paste((*color, 255), (8, 8, 24, 24))
    return image


def _generate(pipe, **kwargs) -> torch.Tensor:  # type: ignore[no-untyped-def]
    refs = [_sprite((200, 40, 40)), _sprite((40, 40, 200))]
    # guidance: the empty negative prompt is padded, so key_valid drops keys in both prefill and decode
    return pipe("a red circle and a blue square", image=refs, num_inference_steps=3, guidance_scale=3.0,
                generator=torch.Generator().manual_seed(0), output_type="pt", **kwargs).images  # fmt: skip


@pytest.mark.parametrize("use_kv_cache", [True, False])
def test_an_exact_path_through_the_processor_reproduces_the_stock_attention(
    exact_path: str, use_kv_cache: bool
) -> None:
    pipe = build_tiny_pipeline(seed=0)
    pipe.set_progress_bar_config(disable=True)
    plain = _generate(pipe, use_kv_cache=use_kv_cache)
    choice = install_attention(pipe, "int8", attention_chooser("int8", torch.device("cpu"), torch.float32))
    assert choice.path.name == exact_path
    assert all(
        isinstance(b.attn.processor, QuantizedAttnProcessor) for b in pipe.transformer.transformer_blocks
    )
    routed = _generate(pipe, use_kv_cache=use_kv_cache)
    assert relative_l2(routed, plain) < 1e-5


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantized_attention_gives_a_finite_image_close_to_the_plain_one(kind: str) -> None:
    pipe = build_tiny_pipeline(seed=0)
    pipe.set_progress_bar_config(disable=True)
    plain = _generate(pipe)
    choice = install_attention(pipe, kind, attention_chooser(kind, torch.device("cpu"), torch.float32))
    assert choice.path.name == f"cpu-reference-attention-{kind}" and choice.verified
    quantized = _generate(pipe)
    assert torch.isfinite(quantized).all()
    error = relative_l2(quantized, plain)
    # Measured on this untrained tiny model (pixels in [0, 1]): int8 2.3e-5, fp8 8.8e-5.
    assert 0 < error < {"int8": 2e-4, "fp8": 5e-4}[kind], error


def test_a_transformer_without_qwen_image_21_attention_is_refused() -> None:
    class Pipeline:
        transformer = torch.nn.Linear(2, 2)

    with pytest.raises(
        InputError, match=r"--attention int8: quantized attention supports Qwen-Image-2\.1"
    ) as info:
        install_attention(Pipeline(), "int8", attention_chooser("int8", torch.device("cpu"), torch.float32))
    assert info.value.field == "attention"


def test_generate_command_takes_the_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "img.png"
    args = [
        "generate",
        "--prompt",
        "a red circle",
        "--steps",
        "2",
        "--seed",
        "0",
        "--size",
        "64x64",
        "--out",
        str(out),
    ]
    assert main([*args, "--attention", "int8"]) == 0
    assert "attention  cpu-reference-attention-int8 (int8 Q.K^T)" in capsys.readouterr().out
    with Image.open(out) as image:
        quantized = torch.from_numpy(np.asarray(image, dtype=np.float32))
    assert main(args) == 0
    assert "attention" not in capsys.readouterr().out
    with Image.open(out) as image:
        plain = torch.from_numpy(np.asarray(image, dtype=np.float32))
    # The bundled demo model, 2 steps at 64x64: 8-bit pixels within a few levels of the plain image.
    assert (quantized - plain).abs().mean() < 3.0


@pytest.fixture
def cudnn_wrapper_on_cpu() -> Iterator[str]:
    """cuDNN's fp8-fp8 path as a CPU path: its wrapper (quantizing V, the ops, the output's scale, the masked calls'
    route) with the op's CPU kernel, the same arithmetic in torch ops."""
    from ditq.kernels.attention.cudnn import attend_cudnn
    from ditq.kernels.attention.reference import quantize_qk_reference

    register_attention_kernel(name="test-cudnn-wrapper", kind="fp8-fp8", device_type="cpu", priority=500,
                              quantize=quantize_qk_reference)(attend_cudnn)  # fmt: skip
    yield "test-cudnn-wrapper"
    unregister_attention_kernel("test-cudnn-wrapper")


@pytest.mark.slow
def test_the_cudnn_paths_wrapper_compiles_to_two_graphs_and_draws_the_reference_arithmetics_pixels(
    cudnn_wrapper_on_cpu: str,
) -> None:
    """Issue 43: the fp8-fp8 path compiled as a server compiles it. Its masked calls (here every decode call: the
    demo's prompts come padded) once went through the reference's loop over query chunks, which tied a graph to
    each sequence length: 8 graphs where the other paths compile 2. They are one op now."""
    from torch._dynamo.utils import counters

    from ditq.demo import default_model_dir
    from ditq.pipeline.open import load_pipeline
    from ditq.runtime.adapter import PipelineAdapter
    from ditq.serve.cost import calibrate

    eager = load_pipeline(default_model_dir(), device="cpu")
    reference = install_attention(
        eager, "fp8-fp8", attention_chooser("fp8-fp8", torch.device("cpu"), torch.float32)
    )
    assert reference.path.name == cudnn_wrapper_on_cpu
    expected = _generate(eager, height=64, width=64)
    torch._dynamo.reset()
    compiled = load_pipeline(default_model_dir(), device="cpu", compile="aot_eager")
    install_attention(compiled, "fp8-fp8", attention_chooser("fp8-fp8", torch.device("cpu"), torch.float32))
    graphs, breaks = int(counters["stats"]["unique_graphs"]), sum(counters["graph_break"].values())
    calibrate(PipelineAdapter(compiled), torch.device("cpu"), max_pixels=64 * 64, time_budget_s=600)
    assert int(counters["stats"]["unique_graphs"]) - graphs == 2
    assert sum(counters["graph_break"].values()) == breaks
    assert relative_l2(_generate(compiled, height=64, width=64), expected) < 1e-3
