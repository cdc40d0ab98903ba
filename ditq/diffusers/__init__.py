"""``import ditq.diffusers``: diffusers' own ``from_pretrained`` loads ditq (compressed-tensors) artifacts.

    import ditq.diffusers  # noqa: F401
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained("artifacts/qwen-image-fp8", dtype=torch.bfloat16)

diffusers discovers no quantization backend from outside its package (no entry point, no public registration
call): ``DiffusersAutoQuantizer`` looks ``quant_method`` up in two module-level dicts of
``diffusers.quantizers.auto``, and ``DiffusionPipeline.from_pretrained`` looks a pipeline's ``_class_name`` up in
the ``diffusers`` namespace alone. ``register`` is therefore a monkeypatch of diffusers' private registry, kept
here and nowhere else; it adds, idempotently:

- ``AUTO_QUANTIZATION_CONFIG_MAPPING`` and ``AUTO_QUANTIZER_MAPPING``: ``compressed-tensors`` (both spellings) ->
  ``CompressedTensorsConfig`` and ``CompressedTensorsQuantizer`` (``ditq.runtime.diffusers_quantizer``);
- the ``diffusers`` namespace: ditq's own pipeline class, ``DitqDemoPipeline``, which the demo model's
  ``model_index.json`` names (``DitqDemoPipeline.from_pretrained`` needs no registration);
- ``from_pretrained`` of ``ModelMixin`` and ``DiffusionPipeline``: wrapped so that a local folder passes
  ``refuse_before_diffusers`` first (the loader's refusals, one line naming the file, before diffusers reads it);
- with peft installed, ditq's quantized Linears as a module peft wraps in a LoRA layer
  (``ditq.runtime.lora.register_with_peft``), so that ``load_lora_weights`` takes adapters on them;
- diffusers' block registry (``TransformerBlockRegistry``, which its step caches read): the repeated blocks of each
  model family ditq knows that diffusers leaves out (``ModelFamily.register_cache_blocks``), so that
  ``transformer.enable_cache(FirstBlockCacheConfig(...))`` takes them.

What diffusers would need to host such a backend without this module is in docs/diffusers.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import diffusers
from diffusers import DiffusionPipeline, ModelMixin
from diffusers.quantizers import auto

from ditq.demo.pipeline import DitqDemoPipeline
from ditq.runtime.diffusers_quantizer import (
    QUANT_METHODS,
    CompressedTensorsConfig,
    CompressedTensorsQuantizer,
    refuse_before_diffusers,
)
from ditq.runtime.lora import register_with_peft
from ditq.runtime.models import FAMILIES

__all__ = ["CompressedTensorsConfig", "CompressedTensorsQuantizer", "register"]

# ditq's pipeline classes, which model_index.json files name by class alone
PIPELINE_CLASSES: tuple[type, ...] = (DitqDemoPipeline,)


def _checked(owner: type) -> None:
    """``owner.from_pretrained`` with ``refuse_before_diffusers`` first (once: a second call leaves it)."""
    original = owner.__dict__["from_pretrained"].__func__
    if getattr(original, "ditq_checked", False):
        return

    @functools.wraps(original)
    def from_pretrained(
        cls: type, pretrained_model_name_or_path: Any = None, *args: Any, **kwargs: Any
    ) -> Any:
        refuse_before_diffusers(pretrained_model_name_or_path, kwargs.get("subfolder"))
        return original(cls, pretrained_model_name_or_path, *args, **kwargs)

    checked: Callable[..., Any] = from_pretrained
    checked.ditq_checked = True  # type: ignore[attr-defined]
    owner.from_pretrained = classmethod(checked)  # type: ignore[attr-defined]


def register() -> None:
    """Put the compressed-tensors backend and ditq's pipeline classes where diffusers looks them up."""
    for method in QUANT_METHODS:
        auto.AUTO_QUANTIZATION_CONFIG_MAPPING[method] = CompressedTensorsConfig
        auto.AUTO_QUANTIZER_MAPPING[method] = CompressedTensorsQuantizer
    for cls in PIPELINE_CLASSES:
        setattr(diffusers, cls.__name__, cls)
    for owner in (ModelMixin, DiffusionPipeline):
        _checked(owner)
    register_with_peft()
    for family in FAMILIES.values():
        family.register_cache_blocks()


register()
