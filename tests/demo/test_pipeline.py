import json

import pytest
import torch
from diffusers import QwenImage21Transformer2DModel
from PIL import Image

from ditq.demo import DitqDemoPipeline, build_tiny_pipeline, load_demo_pipeline


def _sprite(color: tuple[int, int, int]) -> Image.Image:
    image = Image.new("RGBA", (32, 32), (0, 0, 0, 0))
    image.paste((*color, 255), (8, 8, 24, 24))
    return image


@pytest.fixture(scope="module")
def pipe() -> DitqDemoPipeline:
    pipeline = build_tiny_pipeline(seed=0)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def _generate(pipe, seed, **kwargs):
    kwargs.setdefault("num_inference_steps", 3)
    return pipe("a red circle on a white background", generator=torch.Generator().manual_seed(seed), **kwargs)


def test_generates_rgba_deterministically_for_a_seed(pipe):
    first, again, other = (_generate(pipe, seed, output_type="pt").images for seed in (0, 0, 1))
    assert first.shape == (1, 4, 64, 64)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    image = _generate(pipe, 0).images[0]
    assert isinstance(image, Image.Image) and image.mode == "RGBA" and image.size == (64, 64)


@pytest.mark.parametrize("num_refs", [1, 2, 3, 4])
def test_edits_with_references_and_kv_cache_match_full_recompute(pipe, num_refs):
    refs = [_sprite((40 * i, 200, 40)) for i in range(num_refs)]
    cached = _generate(pipe, 3, image=refs, output_type="pt").images
    full = _generate(pipe, 3, image=refs, output_type="pt", use_kv_cache=False).images
    assert cached.shape == (1, 4, 64, 64)
    assert torch.allclose(cached, full, atol=1e-4)
    # references condition the result
    other = _generate(pipe, 3, image=[_sprite((200, 40, 200))] * num_refs, output_type="pt").images
    assert not torch.allclose(cached, other)


def test_batch_guidance_and_sizes(pipe):
    out = pipe(
        ["a red circle", "two blue stars"],
        num_images_per_prompt=2,
        height=32,
        width=48,
        num_inference_steps=2,
    )
    assert len(out.images) == 4 and out.images[0].size == (48, 32)
    unguided = _generate(pipe, 0, guidance_scale=1.0, output_type="pt").images
    guided = _generate(pipe, 0, true_cfg_scale=4.0, output_type="pt").images
    assert not torch.allclose(unguided, guided)


def test_bad_inputs_are_rejected(pipe):
    with pytest.raises(ValueError, match="multiples of 8"):
        pipe("a red circle", height=60)
    with pytest.raises(ValueError, match="at most 4"):
        pipe("a red circle", image=[_sprite((1, 2, 3))] * 5)


def test_callback_sees_every_step(pipe):
    seen = []

    def callback(pipeline, index, timestep, tensors):
        seen.append((index, tuple(tensors["latents"].shape)))
        return tensors

    _generate(pipe, 0, num_inference_steps=4, callback_on_step_end=callback)
    assert seen == [(i, (1, 256, 64)) for i in range(4)]


def test_save_load_round_trip_in_diffusers_layout(pipe, tmp_path):
    pipe.save_pretrained(tmp_path)
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert index["_class_name"] == "DitqDemoPipeline"
    assert index["transformer"] == ["diffusers", "QwenImage21Transformer2DModel"]
    assert index["text_encoder"] == ["ditq.demo.text_encoder", "DemoTextEncoder"]
    loaded = load_demo_pipeline(tmp_path)
    loaded.set_progress_bar_config(disable=True)
    assert isinstance(loaded.transformer, QwenImage21Transformer2DModel)
    for name in ("transformer", "text_encoder"):
        saved, restored = getattr(pipe, name).state_dict(), getattr(loaded, name).state_dict()
        assert saved.keys() == restored.keys() and all(torch.equal(saved[k], restored[k]) for k in saved)
    expected = _generate(pipe, 5, output_type="pt").images
    assert torch.allclose(_generate(loaded, 5, output_type="pt").images, expected, atol=1e-5)


def test_repeated_block_linears_are_16_aligned():
    from ditq.demo.presets import DEMO, TINY

    for preset in (DEMO, TINY):
        model = QwenImage21Transformer2DModel(**preset["transformer"])
        linears = [m for m in model.transformer_blocks.modules() if isinstance(m, torch.nn.Linear)]
        assert linears and all(m.in_features % 16 == 0 and m.out_features % 16 == 0 for m in linears)
