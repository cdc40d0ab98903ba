"""The bundled demo model: a miniature Qwen-Image-2.1 DiT that draws shapes, trained by `ditq.demo.train`.

`load_demo_pipeline(directory)` loads a saved demo pipeline (diffusers layout). `DiffusionPipeline.from_pretrained`
resolves a pipeline class in the diffusers namespace only, so use this function,
`DitqDemoPipeline.from_pretrained(directory)` (importing `ditq.demo` first, so that diffusers finds the text
encoder's module), or `import ditq.diffusers` first, which registers the class there (and loads artifacts).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ditq.lazy import lazy_names

if TYPE_CHECKING:
    import torch

    from ditq.demo.pipeline import DitqDemoPipeline
    from ditq.demo.text_encoder import DemoTextEncoder

# The classes, imported on first use (diffusers finds the text encoder's here too): the paths below need no torch.
_LAZY: dict[str, str] = {
    "DitqDemoPipeline": "ditq.demo.pipeline",
    "DemoTextEncoder": "ditq.demo.text_encoder",
}


__getattr__ = lazy_names(__name__, _LAZY)


__all__ = [
    "DemoTextEncoder",
    "DitqDemoPipeline",
    "build_tiny_pipeline",
    "default_model_dir",
    "fixtures_path",
    "load_demo_pipeline",
    "plan_path",
    "references_dir",
]

_HERE = Path(__file__).resolve().parent


def default_model_dir() -> Path:
    """The bundled, trained demo model: a diffusers directory inside the package."""
    return _HERE / "model"


def fixtures_path() -> Path:
    """The demo fixtures (id -> mode, references, width, height, prompt, negative_prompt)."""
    return _HERE / "fixtures.json"


def plan_path() -> Path:
    """The demo model's mixed-precision plan (``ditq plan ditq/demo/model --schemes fp8,w8a8,w8a16``, its command
    inside), shipped so that ``ditq demo`` judges a planned candidate beside the uniform schemes without
    searching for it first."""
    return _HERE / "PLAN.json"


def references_dir() -> Path:
    """The reference PNGs the fixtures name (file = <reference id>.png)."""
    return _HERE / "references"


def build_tiny_pipeline(seed: int = 0) -> DitqDemoPipeline:
    """An untrained, tiny pipeline of the same classes, for fast tests."""
    from ditq.demo.presets import TINY, build_pipeline

    return build_pipeline(TINY, seed=seed)


def load_demo_pipeline(
    directory: str | Path | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
) -> DitqDemoPipeline:
    """Load a demo pipeline saved in diffusers layout (default: the bundled model), in ``dtype`` (default
    float32)."""
    import torch

    from ditq.demo.pipeline import DitqDemoPipeline

    directory = Path(directory) if directory is not None else default_model_dir()
    if not (directory / "model_index.json").is_file():
        raise FileNotFoundError(f"{directory}: no model_index.json (not a diffusers pipeline directory)")
    pipeline = DitqDemoPipeline.from_pretrained(directory, dtype=dtype or torch.float32)
    return pipeline.to(device)
