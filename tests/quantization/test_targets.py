"""Target discovery from the model's own structure, on real diffusers (and transformers) classes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import AuraFlowTransformer2DModel
from tiny_models import TINY_CONFIGS, build_tiny, build_tiny_text_encoder

from ditq.errors import InputError
from ditq.quantization.targets import (
    LinearLayer,
    TargetPlan,
    _shape_reason,
    block_lists,
    build_meta_model,
    plan_targets,
)
from ditq.runtime.loader import component_entries

# Per class: the block lists and how many Linears each reason keeps (tiny configs of tests/tiny_models.py).
EXPECTED = {
    "qwenimage": (["transformer_blocks"], 24, {"outside": 6, "modulation": 4}),
    "qwenimage21": (["transformer_blocks"], 14, {"outside": 8}),
    "flux": (["transformer_blocks", "single_transformer_blocks"], 22, {"outside": 8, "modulation": 4}),
    "sd3": (["transformer_blocks"], 21, {"outside": 7, "modulation": 4}),
    "wan": (["blocks"], 16, {"outside": 6, "shape guard": 4}),
}


def _shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def _plan(model: torch.nn.Module, **kwargs) -> TargetPlan:  # type: ignore[no-untyped-def]
    return plan_targets(model, "transformer", _shapes(model), **kwargs)


def _count(plan: TargetPlan) -> dict[str, int]:
    counts: dict[str, int] = {}
    for reason in plan.ignored.values():
        key = next(
            k for k in ("outside", "modulation", "shape guard", "user choice", "not a Linear") if k in reason
        )
        if key != "not a Linear":
            counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_targets_are_block_linears(name: str) -> None:
    model = build_tiny(name)
    plan = _plan(model)
    blocks, n_targets, reasons = EXPECTED[name]
    assert plan.block_lists == blocks
    assert len(plan.targets) == n_targets
    assert _count(plan) == reasons
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    weighted = {n for n, m in model.named_modules() if isinstance(getattr(m, "weight", None), torch.Tensor)}
    assert set(plan.targets) | set(plan.ignored) == weighted  # norms, convolutions and embeddings too
    assert {n for n, r in plan.ignored.items() if r.startswith("not a Linear")} == weighted - linears
    assert not set(plan.targets) & set(plan.ignored)
    for prefix, layer in plan.targets.items():
        assert any(prefix.startswith(f"{b}.") for b in blocks)
        assert layer.in_features % 16 == 0 and layer.out_features % 16 == 0
        assert "norm" not in prefix and "_mod" not in prefix


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_meta_model_from_config_matches(name: str, model_dir) -> None:  # type: ignore[no-untyped-def]
    source: Path = model_dir(name)
    cls = TINY_CONFIGS[name][0]
    entries = component_entries(source / "transformer", None)
    meta = build_meta_model(source / "transformer", "diffusers", cls.__name__, entries)
    assert all(p.device.type == "meta" for p in meta.parameters())
    assert _plan(meta).targets == _plan(build_tiny(name)).targets


def test_boundary_layers_named() -> None:
    plan = _plan(build_tiny("flux"))
    for prefix in ("x_embedder", "context_embedder", "proj_out", "norm_out.linear"):
        assert plan.ignored[prefix].startswith("boundary: outside")
    assert plan.ignored["transformer_blocks.0.norm1.linear"] == "boundary: modulation/adaLN inside a block"
    assert (
        plan.ignored["single_transformer_blocks.1.norm.linear"] == "boundary: modulation/adaLN inside a block"
    )


def test_shape_guard_reason_names_the_width() -> None:
    plan = _plan(build_tiny("wan"))
    assert plan.ignored["blocks.0.ffn.net.0.proj"] == "shape guard: out_features 40 is not a multiple of 16"
    assert plan.ignored["blocks.1.ffn.net.2"] == "shape guard: in_features 40 is not a multiple of 16"


def test_too_small_and_group_size_guards() -> None:
    assert _shape_reason(LinearLayer("x", 32, 32), 64, None) == (
        "shape guard: too small to gain (32x32, minimum 64)"
    )
    model = build_tiny("qwenimage21")
    grouped = _plan(model, group_size=48)
    assert "group size 48" in grouped.ignored["transformer_blocks.0.attn.to_q"]  # in_features 32
    assert "transformer_blocks.0.img_mlp.out" in grouped.targets  # in_features 96
    assert "transformer_blocks.0.attn.to_q" in _plan(model, group_size=32).targets


def test_user_regexes_override() -> None:
    model = build_tiny("flux")
    ignored = _plan(model, ignore=[r"^single_transformer_blocks\.1\."])
    assert ignored.ignored["single_transformer_blocks.1.attn.to_q"].startswith("user choice: --ignore")
    assert "single_transformer_blocks.0.attn.to_q" in ignored.targets
    chosen = _plan(model, targets=[r"attn\.to_[qkv]$", r"^context_embedder$"])
    blocks = ("transformer_blocks.0", "single_transformer_blocks.0", "single_transformer_blocks.1")
    assert set(chosen.targets) == {f"{b}.attn.to_{x}" for b in blocks for x in "qkv"} | {"context_embedder"}
    assert chosen.ignored["proj_out"] == "user choice: not matched by --targets"


def test_targets_regex_still_shape_guarded() -> None:
    plan = _plan(build_tiny("wan"), targets=[r"ffn", r"attn1\.to_q$"])
    assert not plan.targets.keys() & {"blocks.0.ffn.net.0.proj"}
    assert plan.ignored["blocks.0.ffn.net.0.proj"].startswith("shape guard")


def test_bad_regex_and_nothing_to_quantize_are_input_errors() -> None:
    model = build_tiny("flux")
    with pytest.raises(InputError, match="--ignore"):
        _plan(model, ignore=["("])
    with pytest.raises(InputError, match="no Linear layer to quantize"):
        _plan(model, ignore=[".*"])


def test_transformers_text_encoder() -> None:
    encoder = build_tiny_text_encoder()
    plan = plan_targets(encoder, "text_encoder", _shapes(encoder))
    assert plan.block_lists == ["encoder.block"]
    assert len(plan.targets) == 10  # 2 blocks x (q, k, v, o, wi)
    assert "encoder.block.0.layer.1.DenseReluDense.wi" in plan.targets
    # T5DenseActDense.forward casts its input to self.wo.weight.dtype: wo keeps a weight of the source dtype
    assert plan.ignored["encoder.block.0.layer.1.DenseReluDense.wo"].startswith(
        "reads .weight: T5DenseActDense reads self.wo.weight directly"
    )


def test_class_not_on_the_list() -> None:
    """AuraFlow was never looked at while writing ditq: two block lists, found from structure alone."""
    torch.manual_seed(0)
    model = AuraFlowTransformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        num_mmdit_layers=1,
        num_single_dit_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        caption_projection_dim=32,
        out_channels=4,
        pos_embed_max_size=16,
    )
    plan = _plan(model)
    assert plan.block_lists == ["joint_transformer_blocks", "single_transformer_blocks"]
    assert all(
        p.startswith(("joint_transformer_blocks.", "single_transformer_blocks.")) for p in plan.targets
    )
    assert "single_transformer_blocks.0.attn.to_q" in plan.targets
    assert all("norm" in p for p in plan.ignored if p.startswith(("joint_", "single_")))


def test_checkpoint_names_differing_from_module_paths() -> None:
    """A checkpoint that spells prefixes differently (e.g. without a wrapper module) is matched by suffix."""
    model = build_tiny("qwenimage21")
    shapes = {f"inner.{k}": v for k, v in _shapes(model).items()}
    plan = plan_targets(model, "transformer", shapes)
    assert "inner.transformer_blocks.0.attn.to_q" in plan.targets


def test_shape_mismatch_with_config_is_an_input_error() -> None:
    model = build_tiny("qwenimage21")
    shapes = _shapes(model)
    shapes["transformer_blocks.0.attn.to_q.weight"] = (32, 48)
    with pytest.raises(InputError, match=r"to_q.weight has shape \[32, 48\]"):
        plan_targets(model, "transformer", shapes)


def test_block_lists_outermost_only() -> None:
    model = build_tiny("sd3")
    assert block_lists(model) == ["transformer_blocks"]  # attn.to_out ModuleLists inside are not block lists
