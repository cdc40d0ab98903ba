"""The prefill's attention as one op under --compile: a compiled block takes the prefix segments as a table, draws
the eager pipeline's pixels with stock and with quantized attention, and one prefix graph serves every reference
count (dynamo unrolled the segment loop and guarded on its length: a prefix graph per reference count)."""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from torch._dynamo.utils import counters

from ditq.demo import build_tiny_pipeline
from ditq.doctor.attention import attention_chooser
from ditq.runtime.attention import install_attention
from ditq.runtime.compile import compile_pipeline
from ditq.runtime.models.qwenimage21.attention import QuantizedAttnProcessor
from ditq.runtime.models.qwenimage21.prefill import TabulatedPrefillProcessor, segment_table, segments_of


def _sprite(color: tuple[int, int, int]) -> Image.Image:
    image = Image.new("RGBA", (32, 32), (0, 0, 0, 0))
    image.paste((*color, 255), (8, 8, 24, 24))
    return image


REFERENCES = [_sprite((200, 40, 40)), _sprite((40, 40, 200)), _sprite((40, 200, 40)), _sprite((200, 200, 40))]


def _generate(pipe, references: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    # guidance: the empty negative prompt is padded, so key_valid drops keys in the prefill and the decode
    return pipe("a red circle and a blue square", image=REFERENCES[:references], num_inference_steps=2,
                guidance_scale=3.0, generator=torch.Generator().manual_seed(0), output_type="pt").images  # fmt: skip


def _graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


def test_a_segment_table_holds_the_segments_flat() -> None:
    segments = [(0, 7, True), (7, 23, False), (23, 24, True)]
    table = segment_table(segments)
    assert table.dtype == torch.int64 and table.shape == (9,) and table.device.type == "cpu"
    assert segments_of(table) == segments
    assert segment_table([(0, 5, True)]).shape == (3,)  # a prompt alone: a length dynamo does not specialise


@pytest.mark.parametrize("attention", ["stock", "int8"])
def test_compiled_blocks_draw_the_eager_pixels_with_one_prefix_graph_for_every_reference_count(
    attention: str,
) -> None:
    def build():  # type: ignore[no-untyped-def]
        pipe = build_tiny_pipeline(seed=0)
        pipe.set_progress_bar_config(disable=True)
        if attention != "stock":
            install_attention(
                pipe, attention, attention_chooser(attention, torch.device("cpu"), torch.float32)
            )
        return pipe

    eager, compiled = build(), build()
    torch._dynamo.reset()
    compile_pipeline(compiled, "eager")
    processors = [block.attn.processor for block in compiled.transformer.transformer_blocks]
    expected = QuantizedAttnProcessor if attention != "stock" else TabulatedPrefillProcessor
    assert all(type(p) is expected for p in processors), processors
    start = _graphs()
    # the CPU reference path of quantized attention chunks its decode's queries by the key length, which dynamo
    # guards (a cached-step graph per key length): its graphs are not counted here, and two reference counts show
    # its pixels; the CUDA kernels are one op each (tests/runtime/test_runtime_gpu.py counts their graphs)
    for references in (2, 0, 1, 4) if attention == "stock" else (2, 0):
        assert torch.equal(_generate(compiled, references), _generate(eager, references)), references
    if attention == "stock":
        # the cached step and the prefix step, whatever the number of references (it was one prefix graph for each)
        assert _graphs() - start == 2
