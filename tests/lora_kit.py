"""A seeded LoRA adapter made with peft on the tiny demo pipeline, and its files in peft's and diffusers' formats:
what the LoRA tests (``tests/runtime/test_lora.py``, ``tests/serve/test_serve_lora.py``,
``tests/commands/test_generate_lora.py``) load. Needs peft (the caller skips without it)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

__all__ = ["TARGETS", "add_seeded_adapter", "drawn_with", "load_both_adapters", "save_adapter_files"]

TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]  # the attention projections of every block


def add_seeded_adapter(transformer: Any, name: str = "style") -> dict[str, torch.Tensor]:
    """A rank-4 adapter ``name`` on ``transformer``'s attention projections, seeded (0): random A and B
    (``init_lora_weights=False``), B 16 times larger, so that it visibly changes the image. Its state dict carries no
    alpha, so alpha = r as diffusers reads it back. Returns the state dict in peft's keys (contiguous)."""
    import peft

    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, lora_alpha=4, target_modules=TARGETS, init_lora_weights=False)
    transformer.add_adapter(config, adapter_name=name)
    with torch.no_grad():
        for module in transformer.modules():
            if isinstance(module, peft.tuners.lora.LoraLayer):
                module.lora_B[name].weight.mul_(16)
    state = peft.utils.get_peft_model_state_dict(transformer, adapter_name=name)
    return {key: value.contiguous() for key, value in state.items()}


def save_adapter_files(state: dict[str, torch.Tensor], folder: Path) -> dict[str, Path]:
    """``state`` saved with peft's keys (``peft``: ``folder/style.safetensors``) and with diffusers' (``diffusers``:
    the folder ``folder/diffusers`` holding ``pytorch_lora_weights.safetensors``, keys ``transformer.…``)."""
    (folder / "diffusers").mkdir(parents=True)
    save_file(state, folder / "style.safetensors")
    save_file(
        {f"transformer.{key}": value for key, value in state.items()},
        folder / "diffusers/pytorch_lora_weights.safetensors",
    )
    return {"peft": folder / "style.safetensors", "diffusers": folder / "diffusers"}


def load_both_adapters(pipeline: Any, files: dict[str, Path]) -> None:
    """``save_adapter_files``' two files on ``pipeline``'s transformer by diffusers' own calls: ``style`` from peft's
    file, ``bold`` from diffusers' folder."""
    pipeline.transformer.load_lora_adapter(str(files["peft"]), adapter_name="style", prefix=None)
    with warnings.catch_warnings():  # peft's note that the model holds an adapter already
        warnings.simplefilter("ignore", UserWarning)
        pipeline.transformer.load_lora_adapter(
            str(files["diffusers"]), weight_name="pytorch_lora_weights.safetensors", adapter_name="bold"
        )


def drawn_with(
    pipeline: Any, adapters: dict[str, float], prompt: str, seed: int = 1, steps: int = 3
) -> np.ndarray:
    """``pipeline``'s 32x32 RGB image of ``prompt`` with ``adapters`` (name -> scale; none: LoRA disabled)."""
    if adapters:
        pipeline.transformer.enable_lora()
        pipeline.transformer.set_adapters(list(adapters), list(adapters.values()))
    else:
        pipeline.transformer.disable_lora()
    generator = torch.Generator().manual_seed(seed)
    image = pipeline(
        prompt=prompt, width=32, height=32, num_inference_steps=steps, generator=generator
    ).images[0]
    return np.asarray(image.convert("RGB"))
