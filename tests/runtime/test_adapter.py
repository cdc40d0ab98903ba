"""PipelineAdapter: signature mapping, refusals naming the argument, per-stage timings."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from PIL import Image

from ditq.errors import InputError
from ditq.runtime.adapter import GenerationRequest, PipelineAdapter, parse_size


class _Output:
    def __init__(self, images: list[Image.Image]) -> None:
        self.images = images


class _Decoder(torch.nn.Module):
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return latents.tanh()


class _EditPipeline:
    """Stands in for an edit pipeline: image list, true CFG, steps with a callback, encode/decode stages."""

    vae_scale_factor = 8

    def __init__(self) -> None:
        with torch.random.fork_rng():  # the same weights whatever ran before (the test order is not fixed)
            torch.manual_seed(0)
            self.transformer = torch.nn.Linear(4, 4)
        self.vae = _Decoder()
        self.calls: list[dict[str, Any]] = []

    def encode_prompt(self, prompt: str) -> torch.Tensor:
        return torch.full((1, 4), float(len(prompt)))

    def __call__(
        self,
        prompt: str,
        image: list[Image.Image] | None = None,
        negative_prompt: str | None = None,
        true_cfg_scale: float = 4.0,
        height: int = 64,
        width: int = 64,
        num_inference_steps: int = 3,
        num_images_per_prompt: int = 1,
        generator: torch.Generator | None = None,
        output_type: str = "pil",
        callback_on_step_end: Any = None,
    ) -> _Output:
        self.calls.append(
            dict(prompt=prompt, image=image, true_cfg_scale=true_cfg_scale, generator=generator)
        )
        embeds = self.encode_prompt(prompt)
        latents = torch.randn(1, 4, generator=generator)
        for step in range(num_inference_steps):
            latents = self.transformer(latents + embeds)
            if callback_on_step_end is not None:
                callback_on_step_end(self, step, step, {})
        value = int(self.vae.decode(latents).abs().sum() * 1000) % 255  # the third decimal: seeds differ
        return _Output([Image.new("RGB", (width, height), (value, 0, 0))] * num_images_per_prompt)


class _TextToImagePipeline:
    """No image input, no negative prompt, classic guidance_scale only, no callback."""

    def __call__(
        self, prompt: str, guidance_scale: float = 3.5, height: int = 32, width: int = 32
    ) -> _Output:
        return _Output([Image.new("RGB", (width, height))])


def test_maps_generic_fields_onto_the_signature() -> None:
    pipeline = _EditPipeline()
    adapter = PipelineAdapter(pipeline)
    assert adapter.max_reference_images == 4
    assert adapter.size_alignment == 16
    assert adapter.supports("negative_prompt") and adapter.supports("true_cfg_scale")
    refs = [Image.new("RGB", (16, 16)) for _ in range(2)]
    request = GenerationRequest(prompt="a cat", images=refs, guidance_scale=2.5, seed=0, width=32, height=48)
    kwargs = adapter.build_kwargs(request)
    assert kwargs["image"] == refs
    # No guidance_scale parameter: the generic guidance knob lands on true_cfg_scale.
    assert kwargs["true_cfg_scale"] == 2.5 and "guidance_scale" not in kwargs
    assert (kwargs["width"], kwargs["height"]) == (32, 48)
    assert isinstance(kwargs["generator"], torch.Generator) and kwargs["generator"].initial_seed() == 0


def test_call_reports_stage_timings_and_one_time_per_step() -> None:
    pipeline = _EditPipeline()
    adapter = PipelineAdapter(pipeline)
    result = adapter(GenerationRequest(prompt="a cat", num_inference_steps=5, seed=7, num_images=2))
    assert len(result.images) == 2 and result.images[0].size == (64, 64)
    assert len(result.step_times) == 5 and all(t >= 0 for t in result.step_times)
    for stage in ("text_encoding", "denoising", "decoding", "postprocess", "total"):
        assert result.timings[stage] >= 0.0
    assert result.timings["text_encoding"] > 0 and result.timings["decoding"] > 0
    assert result.timings["total"] >= result.timings["denoising"]
    assert result.peak_memory_bytes is None  # CPU
    # The stage wrappers are gone after the call.
    assert "encode_prompt" not in vars(pipeline) and "decode" not in vars(pipeline.vae)


def test_same_seed_same_image_and_seed_zero_is_a_seed() -> None:
    adapter = PipelineAdapter(_EditPipeline())
    first = adapter(GenerationRequest(prompt="x", seed=0)).images[0].getpixel((0, 0))
    second = adapter(GenerationRequest(prompt="x", seed=0)).images[0].getpixel((0, 0))
    other = [adapter(GenerationRequest(prompt="x", seed=s)).images[0].getpixel((0, 0)) for s in (1, 2, 3)]
    assert first == second
    assert any(value != first for value in other)


@pytest.mark.parametrize(
    ("request_fields", "named"),
    [
        ({"negative_prompt": "blurry"}, "negative_prompt"),
        ({"images": [Image.new("RGB", (8, 8))]}, "images"),
        ({"seed": 3}, "seed"),
        ({"num_images": 2}, "num_images"),
        ({"num_inference_steps": 4}, "num_inference_steps"),
    ],
)
def test_an_argument_the_pipeline_cannot_take_is_named(request_fields: dict[str, Any], named: str) -> None:
    adapter = PipelineAdapter(_TextToImagePipeline())
    with pytest.raises(
        InputError, match=f"_TextToImagePipeline cannot take the argument '{named}'"
    ) as raised:
        adapter.build_kwargs(GenerationRequest(prompt="p", **request_fields))
    assert raised.value.field == named


def test_text_to_image_pipeline_maps_true_cfg_onto_guidance_scale() -> None:
    adapter = PipelineAdapter(_TextToImagePipeline())
    assert adapter.max_reference_images == 0
    assert not adapter.supports("negative_prompt")
    assert adapter.build_kwargs(GenerationRequest(prompt="p", true_cfg_scale=5.0)) == {
        "prompt": "p",
        "guidance_scale": 5.0,
    }
    result = adapter(GenerationRequest(prompt="p", width=32, height=32))
    assert result.step_times == [] and result.images[0].size == (32, 32)


@pytest.mark.parametrize(
    ("request_fields", "field", "message"),
    [
        ({"width": 40}, "width", "width: 40 is not a positive multiple of 16"),
        ({"height": 0}, "height", "height: 0 is not a positive multiple of 16"),
        ({"images": [Image.new("RGB", (8, 8))] * 5}, "images", "5 reference images given"),
        ({"guidance_scale": 1.0, "true_cfg_scale": 2.0}, "true_cfg_scale", "one guidance argument"),
        ({"prompt": ""}, "prompt", "prompt: must not be empty"),
        ({"num_inference_steps": 0}, "num_inference_steps", "must be positive"),
        ({"num_images": 0}, "num_images", "must be at least 1"),
    ],
)
def test_bad_values_are_refused_naming_the_field(
    request_fields: dict[str, Any], field: str, message: str
) -> None:
    adapter = PipelineAdapter(_EditPipeline())
    fields = {"prompt": "p", **request_fields}
    with pytest.raises(InputError, match=message) as raised:
        adapter.build_kwargs(GenerationRequest(**fields))
    assert raised.value.field == field


@pytest.mark.parametrize(("text", "size"), [("32x48", (32, 48)), (" 64X16 ", (64, 16)), ("0x32", (0, 32))])
def test_sizes_are_read_as_width_by_height(text: str, size: tuple[int, int]) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["32by32", "32x", "x32", "1234567x2", "32x32x32", "-32x32"])
def test_a_size_that_is_not_w_by_h_names_the_field(text: str) -> None:
    with pytest.raises(InputError, match=r"^--size: expected WxH") as raised:
        parse_size(text, "--size")
    assert raised.value.field == "--size"
