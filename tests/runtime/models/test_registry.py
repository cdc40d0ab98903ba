"""The registry of model families and the generic code that asks it: a transformer, or one of its blocks, finds its
family (by its class or one it derives from); anything else finds none and is refused in one line where an option
needs a family; the runtime installs the attention path the doctor chose, and nothing where it chose none."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import QwenImage21Transformer2DModel

from ditq.demo import build_tiny_pipeline
from ditq.demo.presets import TINY
from ditq.doctor.attention import AutoAttention, attention_chooser
from ditq.errors import InputError
from ditq.runtime.attention import install_attention
from ditq.runtime.fuse import fuse_projections
from ditq.runtime.kv_cache import install_kv_cache
from ditq.runtime.models import FAMILIES, family_named, model_family
from ditq.runtime.models.qwenimage21 import QWENIMAGE21
from ditq.runtime.models.qwenimage21.attention import QuantizedAttnProcessor

DITQ = Path(__file__).resolve().parents[3] / "ditq"


class _NoFamily:
    transformer = torch.nn.Linear(2, 2)


def test_a_transformer_and_its_blocks_find_their_family_and_nothing_else_finds_one() -> None:
    transformer = build_tiny_pipeline(seed=0).transformer
    assert model_family(transformer) is QWENIMAGE21
    assert all(model_family(block) is QWENIMAGE21 for block in transformer.transformer_blocks)
    assert family_named("QwenImage21Transformer2DModel") is QWENIMAGE21
    assert FAMILIES == {"QwenImage21Transformer2DModel": QWENIMAGE21}
    assert model_family(torch.nn.Linear(2, 2)) is None and model_family(None) is None
    assert family_named("FluxTransformer2DModel") is None
    heads, head_dim = TINY["transformer"]["num_attention_heads"], TINY["transformer"]["attention_head_dim"]
    assert QWENIMAGE21.attention_shape(transformer) == (heads, head_dim)


def test_a_subclass_of_a_known_transformer_belongs_to_its_family() -> None:
    class Derived(QwenImage21Transformer2DModel):
        pass

    assert model_family(Derived(**TINY["transformer"])) is QWENIMAGE21


def test_an_option_that_needs_a_family_refuses_a_transformer_of_none_in_one_line() -> None:
    asked: list[tuple[int, int]] = []

    def choose(heads: int, head_dim: int) -> AutoAttention:
        asked.append((heads, head_dim))
        return AutoAttention(None, {})

    with pytest.raises(InputError, match=r"^--kv-cache int8: Linear keeps no prefix KV cache to quantize$"):
        install_kv_cache(_NoFamily(), "int8")
    with pytest.raises(
        InputError, match=r"^--attention auto: quantized attention supports Qwen-Image-2\.1 \("
    ):
        install_attention(_NoFamily(), "auto", choose)
    assert asked == []  # refused before the doctor is asked
    assert fuse_projections(torch.nn.Linear(2, 2)) == 0  # nothing to fuse, nothing refused


def test_the_runtime_installs_the_doctors_choice_and_nothing_where_it_chose_none() -> None:
    pipe = build_tiny_pipeline(seed=0)
    before = dict(pipe.transformer.attn_processors)
    kept = install_attention(pipe, "auto", lambda heads, head_dim: AutoAttention(None, {}))
    assert kept.path is None and pipe.transformer.attn_processors == before
    choice = install_attention(pipe, "int8", attention_chooser("int8", torch.device("cpu"), torch.float32))
    processors = list(pipe.transformer.attn_processors.values())
    assert choice.path is not None and choice.path.name == "cpu-reference-attention-int8"
    assert all(isinstance(p, QuantizedAttnProcessor) and p.path is choice.path for p in processors)


def test_only_the_model_folders_name_a_model_and_the_doctor_installs_nothing() -> None:
    """Generic code asks the registry: a model's class names appear in its folder under ``runtime/models`` (and in
    the bundled demo model, a Qwen-Image-2.1 pipeline of its own); the doctor chooses and never sets a processor."""
    outside = [
        str(path.relative_to(DITQ))
        for path in DITQ.rglob("*.py")
        if "QwenImage21" in path.read_text()
        and not path.is_relative_to(DITQ / "runtime" / "models")
        and not path.is_relative_to(DITQ / "demo")
    ]
    assert outside == []
    assert [p.name for p in (DITQ / "doctor").rglob("*.py") if "set_processor" in p.read_text()] == []
