"""LoRA adapters on ditq's quantized Linears, through peft's own extension point.

peft wraps the Linear classes it knows (torch's, bitsandbytes', torchao's...) in a LoRA layer; for any other class
it takes a mapping on its config (``LoraConfig._register_custom_module``). diffusers builds that config itself when
``load_lora_weights`` or ``load_lora_adapter`` runs, so ``register_with_peft`` adds ditq's mapping to every
``LoraConfig`` made from then on (``QuantizedLinear`` -> ``QuantizedLoraLinear``). diffusers' ``load_lora_weights``,
``set_adapters``, ``disable_lora`` and ``unload_lora_weights`` then work unchanged on a pipeline ditq loaded, by
``ditq.load_pipeline`` or by diffusers' ``from_pretrained`` after ``import ditq.diffusers`` (both register).

The adapter runs as a side branch in the layer's activation dtype beside the quantized GEMM:
y = Q(x) + B(A(x)) * scale. Merging it into the stored weights is refused: the sum would have to be quantized
again, and the adapter's low-rank update is of the size of the 8-bit (or 4-bit) rounding error it would be folded
into, so most of it would be rounded away; unloading returns the layer as it was. peft is optional: without it
nothing is registered. With it, diffusers imports peft itself (``diffusers.loaders.peft``), so registering when a
pipeline opens costs nothing more.
"""

from __future__ import annotations

import importlib.util
from typing import Any, cast

import torch

from ditq.errors import InputError
from ditq.runtime.modules import QuantizedLinear

__all__ = ["lora_available", "register_with_peft"]

_REGISTERED = "_ditq_quantized_linear_registered"


def lora_available() -> bool:
    """Whether peft is installed (``pip install 'ditq[lora]'``)."""
    return importlib.util.find_spec("peft") is not None


def _lora_class() -> type[torch.nn.Module]:
    from peft.tuners.lora.layer import Linear

    class QuantizedLoraLinear(Linear):
        """peft's LoRA Linear around a ditq ``QuantizedLinear``: the base runs its kernel path; A and B sit on the
        layer's device in its activation dtype (peft casts each input to theirs). DoRA, a LoRA bias and merging are
        refused in one line."""

        def __init__(
            self, base_layer: torch.nn.Module, adapter_name: str, config: Any, **kwargs: Any
        ) -> None:
            if config.use_dora or config.lora_bias:
                feature = "DoRA" if config.use_dora else "lora_bias"
                raise InputError(f"LoRA on a quantized Linear: {feature} is not supported")
            super().__init__(base_layer, adapter_name, config=config, **kwargs)

        def _move_adapter_to_device_of_base_layer(
            self, adapter_name: str, device: torch.device | None = None
        ) -> None:
            # peft reads the dtype from the base layer's weight, which here is the stored 8-bit one (e4m3 would
            # round the adapter's values as they load): the adapter takes the layer's activation dtype instead
            base = cast(QuantizedLinear, self.get_base_layer())
            for adapters in (self.lora_A, self.lora_B):
                if adapter_name in adapters:
                    adapters[adapter_name].to(device or base.qweight.device, base._default_activation_dtype())

        def _get_in_out_features(self, module: torch.nn.Module) -> tuple[int, int]:
            layer = cast(QuantizedLinear, module)
            return layer.in_features, layer.out_features

        def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
            raise InputError(
                "LoRA on a quantized Linear: merging into the stored weights is refused (the sum would be quantized "
                "again, rounding most of the adapter away); it runs beside the quantized GEMM instead"
            )

    return QuantizedLoraLinear


def register_with_peft() -> bool:
    """Every ``LoraConfig`` made from now on maps ditq's ``QuantizedLinear`` to its LoRA layer; once per process.
    False where peft is not installed."""
    if not lora_available():
        return False
    from peft import LoraConfig

    if getattr(LoraConfig, _REGISTERED, False):
        return True
    mapping = {QuantizedLinear: _lora_class()}
    made = LoraConfig.__post_init__

    def __post_init__(self: Any) -> None:
        made(self)
        self._register_custom_module(mapping)

    setattr(LoraConfig, "__post_init__", __post_init__)  # noqa: B010 - a method replaced, not an attribute read
    setattr(LoraConfig, _REGISTERED, True)
    return True
