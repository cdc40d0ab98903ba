"""`DitqDemoPipeline`: text-to-image and 1-4 reference edits with a miniature Qwen-Image-2.1 DiT.

Mirrors `QwenImage21Pipeline`: references are prefix tokens (condition images first, target image last) that the
transformer reads through `img_mask` slots in the text sequence; flow-matching Euler sampling; prefix KV cache
(valid because `causal_condition` modulates text and references from t=0). Instead of a VAE, pixels are packed
exactly (`ditq.demo.packing`), so the alpha channel comes straight from the model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, QwenImage21Transformer2DModel
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache
from diffusers.pipelines.pipeline_utils import DiffusionPipeline, ImagePipelineOutput
from diffusers.utils.torch_utils import randn_tensor
from PIL import Image

from ditq.demo.packing import (
    PIXELS_PER_TOKEN,
    pil_to_pixels,
    pixels_to_pil,
    pixels_to_tokens,
    tokens_to_pixels,
)
from ditq.demo.text_encoder import DemoTextEncoder

__all__ = ["SIZE_ALIGNMENT", "DitqDemoPipeline", "joint_layout"]

# One text slot stands for a 2x2 group of latent tokens, one token for 4x4 pixels: sizes are multiples of 8.
TOKENS_PER_SLOT = 4
SIZE_ALIGNMENT = 2 * PIXELS_PER_TOKEN


def joint_layout(
    text_image_mask: torch.Tensor,
    reference_grid: tuple[int, int],
    num_references: int,
    target_grid: tuple[int, int],
) -> tuple[torch.Tensor, list[list[tuple[int, int, int]]]]:
    """`img_mask` (B, L + target slots) and `img_shapes` for the transformer; grids are (rows, cols) of tokens."""
    batch = text_image_mask.shape[0]
    target_slots = target_grid[0] * target_grid[1] // TOKENS_PER_SLOT
    img_mask = torch.cat([text_image_mask, text_image_mask.new_ones(batch, target_slots)], dim=1)
    shapes = [(1, *reference_grid)] * num_references + [(1, *target_grid)]
    return img_mask, [shapes] * batch


class DitqDemoPipeline(DiffusionPipeline):
    """Prompt (+ up to 4 RGBA references) -> RGBA images. Load with `ditq.demo.load_demo_pipeline(directory)`."""

    model_cpu_offload_seq = "text_encoder->transformer"  # type: ignore[assignment]
    _callback_tensor_inputs: ClassVar[list[str]] = ["latents"]

    def __init__(
        self,
        transformer: QwenImage21Transformer2DModel,
        text_encoder: DemoTextEncoder,
        scheduler: FlowMatchEulerDiscreteScheduler,
        default_size: int = 64,
        reference_size: int = 32,
        default_guidance_scale: float = 3.0,
        default_num_inference_steps: int = 20,
        max_reference_images: int = 4,
    ):
        super().__init__()
        self.register_modules(transformer=transformer, text_encoder=text_encoder, scheduler=scheduler)
        self.register_to_config(
            default_size=default_size,
            reference_size=reference_size,
            default_guidance_scale=default_guidance_scale,
            default_num_inference_steps=default_num_inference_steps,
            max_reference_images=max_reference_images,
        )

    def reference_tokens(self, references: list[list[Image.Image]]) -> torch.Tensor:
        """Per-sample reference lists (equal length) -> (B, sum of reference tokens, 64) float32."""
        side = self.config["reference_size"]
        rows = []
        for images in references:
            pixels = torch.stack(
                [pil_to_pixels(image, (side, side)) for image in images]
            )  # (k, 4, side, side)
            rows.append(pixels_to_tokens(pixels).flatten(0, 1))
        return torch.stack(rows)

    def encode_prompt(
        self, prompts: list[str], num_references: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> prompt embeddings (B, L, D), valid mask (B, L) bool, reference-slot mask (B, L) bool."""
        side_tokens = self.config["reference_size"] // PIXELS_PER_TOKEN
        slots = [side_tokens * side_tokens // TOKENS_PER_SLOT] * num_references
        inputs = self.text_encoder.build_inputs(prompts, slots)
        embeds = self.text_encoder(inputs.input_ids.to(device), inputs.attention_mask.to(device))
        return (
            embeds.to(self.transformer.dtype),
            inputs.attention_mask.to(device),
            inputs.image_mask.to(device),
        )

    def _normalize_references(self, image: Any, batch: int) -> list[list[Image.Image]]:
        if image is None or (isinstance(image, list) and not image):
            return [[] for _ in range(batch)]
        if isinstance(image, Image.Image):
            image = [image]
        if all(isinstance(item, Image.Image) for item in image):
            per_prompt = [list(image)] * batch
        elif len(image) == batch and all(isinstance(item, list) for item in image):
            per_prompt = [list(item) for item in image]
        else:
            raise ValueError("image must be a PIL image, a list of them, or one list per prompt")
        counts = {len(item) for item in per_prompt}
        if len(counts) != 1 or max(counts) > self.config["max_reference_images"]:
            raise ValueError(
                f"image: every prompt needs the same number of references, at most "
                f"{self.config['max_reference_images']}; got {sorted(counts)}"
            )
        return per_prompt

    @torch.no_grad()
    def __call__(
        self,
        prompt: str | list[str],
        negative_prompt: str | None = None,
        image: Image.Image | list[Image.Image] | list[list[Image.Image]] | None = None,
        height: int | None = None,
        width: int | None = None,
        num_inference_steps: int | None = None,
        guidance_scale: float | None = None,
        true_cfg_scale: float | None = None,
        generator: torch.Generator | list[torch.Generator] | None = None,
        num_images_per_prompt: int = 1,
        latents: torch.Tensor | None = None,
        callback_on_step_end: Callable[..., dict[str, Any]] | None = None,
        callback_on_step_end_tensor_inputs: list[str] | None = None,
        output_type: str = "pil",
        return_dict: bool = True,
        use_kv_cache: bool = True,
    ) -> ImagePipelineOutput | tuple:
        """Guidance: `true_cfg_scale` (or its alias `guidance_scale`) > 1 contrasts the prompt with
        `negative_prompt` (the empty prompt when None) over the same references; 1 turns guidance off."""
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        references = self._normalize_references(image, len(prompts))
        prompts = [text for text in prompts for _ in range(num_images_per_prompt)]
        references = [refs for refs in references for _ in range(num_images_per_prompt)]
        height = height or self.config["default_size"]
        width = width or self.config["default_size"]
        if height % SIZE_ALIGNMENT or width % SIZE_ALIGNMENT:
            raise ValueError(f"height and width must be multiples of {SIZE_ALIGNMENT}, got {height}x{width}")
        steps = num_inference_steps or self.config["default_num_inference_steps"]
        scale = true_cfg_scale if true_cfg_scale is not None else guidance_scale
        scale = self.config["default_guidance_scale"] if scale is None else scale
        guided = scale > 1.0
        device = self._execution_device
        batch, num_refs = len(prompts), len(references[0])

        text = prompts + [negative_prompt or ""] * batch if guided else prompts
        embeds, text_mask, slot_mask = self.encode_prompt(text, num_refs, device)
        ref_side = self.config["reference_size"] // PIXELS_PER_TOKEN
        target_grid = (height // PIXELS_PER_TOKEN, width // PIXELS_PER_TOKEN)
        img_mask, img_shapes = joint_layout(slot_mask, (ref_side, ref_side), num_refs, target_grid)
        ref_tokens = self.reference_tokens(references).to(device) if num_refs else None

        shape = (batch, target_grid[0] * target_grid[1], self.transformer.config.in_channels)
        if latents is None:
            latents = randn_tensor(shape, generator=generator, device=device, dtype=torch.float32)
        latents = latents.to(device, torch.float32)
        self.scheduler.set_timesteps(steps, device=device)
        self.scheduler.set_begin_index(0)
        cache = QwenImage21KVCache(len(self.transformer.transformer_blocks)) if use_kv_cache else None
        for index, t in enumerate(self.scheduler.timesteps):
            model_input = latents if ref_tokens is None else torch.cat([ref_tokens, latents], dim=1)
            if guided:
                model_input = torch.cat([model_input, model_input])
            mode = None if cache is None else ("extract" if index == 0 else "cached")
            # a step cache's context (diffusers' pipelines open one per call): the extract call, which runs the
            # whole joint sequence, apart from the later calls on the target tokens, so that a step cache compares
            # a call only with one of its own shape; both guidance branches run in one batched call
            with self.transformer.cache_context("extract" if mode == "extract" else "denoise"):
                prediction = self.transformer(
                    hidden_states=model_input.to(self.transformer.dtype),
                    encoder_hidden_states=embeds,
                    encoder_hidden_states_mask=text_mask,
                    timestep=(t / 1000).expand(model_input.shape[0]).to(self.transformer.dtype),
                    img_shapes=img_shapes,
                    img_mask=img_mask,
                    kv_cache=cache,
                    kv_cache_mode=mode,
                    return_dict=False,
                )[0][:, -shape[1] :].float()
            if guided:
                conditional, unconditional = prediction.chunk(2)
                prediction = unconditional + scale * (conditional - unconditional)
            latents = self.scheduler.step(prediction, t, latents, return_dict=False)[0]
            if callback_on_step_end is not None:
                names = callback_on_step_end_tensor_inputs or ["latents"]
                scope = locals()  # a comprehension has its own locals()
                outputs = callback_on_step_end(self, index, t, {name: scope[name] for name in names})
                latents = outputs.pop("latents", latents)

        pixels = tokens_to_pixels(latents, height, width)  # (B, 4, H, W) in about [-1, 1]
        self.maybe_free_model_hooks()
        if output_type == "latent":
            images: Any = latents
        elif output_type == "pt":
            images = pixels.clamp(-1, 1)
        else:
            images = [pixels_to_pil(item) for item in pixels]
        return ImagePipelineOutput(images=images) if return_dict else (images,)
