"""Model sizes of the demo, as data, and the one function that builds a pipeline from them."""

from __future__ import annotations

from typing import Any

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, QwenImage21Transformer2DModel

from ditq.demo.pipeline import DitqDemoPipeline
from ditq.demo.text_encoder import DemoTextEncoder

__all__ = ["DEMO", "PRESETS", "TINY", "build_pipeline"]

# Every Linear inside the repeated blocks maps multiples of 16 to multiples of 16 (int8 kernel alignment):
# DEMO: to_q/k/v/out 256 -> 256, SwiGLU 256 -> 768 -> 256. TINY: 32 -> 32, 32 -> 64 -> 32.
DEMO: dict[str, dict[str, Any]] = {
    "transformer": {
        "patch_size": 1,
        "in_channels": 64,
        "out_channels": 64,
        "num_layers": 6,
        "attention_head_dim": 64,
        "num_attention_heads": 4,
        "context_in_dim": 128,
        "mlp_ratio": 3,
        "axes_dims_rope": (16, 24, 24),
        "causal_condition": True,
    },
    "text_encoder": {"hidden_size": 128, "num_layers": 2, "num_heads": 4},
}
TINY: dict[str, dict[str, Any]] = {
    "transformer": {
        "patch_size": 1,
        "in_channels": 64,
        "out_channels": 64,
        "num_layers": 2,
        "attention_head_dim": 16,
        "num_attention_heads": 2,
        "context_in_dim": 32,
        "mlp_ratio": 2,
        "axes_dims_rope": (4, 6, 6),
        "causal_condition": True,
    },
    "text_encoder": {"hidden_size": 32, "num_layers": 1, "num_heads": 2},
}
PRESETS = {"demo": DEMO, "tiny": TINY}


def build_pipeline(preset: dict[str, dict[str, Any]], seed: int = 0) -> DitqDemoPipeline:
    """A freshly initialized (untrained) float32 pipeline of `preset`; weights depend only on `seed`."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = QwenImage21Transformer2DModel(**preset["transformer"])
        text_encoder = DemoTextEncoder(**preset["text_encoder"])
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0)
    return DitqDemoPipeline(transformer=transformer, text_encoder=text_encoder, scheduler=scheduler)
