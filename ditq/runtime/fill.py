"""Filling a meta-built model with stored tensors, one at a time: the dtype each tensor takes, and its place.

Dtype policy: stored quantized tensors keep their stored dtype (a scale, float32, bfloat16 or float16 as verify
accepts, becomes float32, once ``Codec.scale_problem`` found none); every other floating tensor takes the
run dtype, or float32 inside the model's ``_keep_in_fp32_modules``; integer
tensors stay as stored.
"""

from __future__ import annotations

import torch

from ditq.checkpoint.codecs import SCALE, codec_for
from ditq.checkpoint.safetensors_io import TensorEntry
from ditq.errors import InputError
from ditq.runtime.embedding import QuantizedEmbedding
from ditq.runtime.modules import QuantizedLinear

__all__ = ["assign_tensor"]


def _keep_float32(model: torch.nn.Module, name: str) -> bool:
    keep = getattr(model, "_keep_in_fp32_modules", None) or []
    return any(part in name.split(".") for part in keep)


def assign_tensor(
    model: torch.nn.Module,
    name: str,
    tensor: torch.Tensor,
    entry: TensorEntry,
    device: torch.device,
    dtype: torch.dtype,
) -> None:
    """Put ``tensor`` in place of the parameter or buffer ``name``, in the policy's dtype, on ``device``."""
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    placeholder = module._parameters.get(attr) if attr in module._parameters else module._buffers.get(attr)
    assert placeholder is not None
    if tuple(placeholder.shape) != tuple(tensor.shape):
        raise InputError(
            f"{entry.path}: tensor {name!r} has shape {tuple(tensor.shape)}, {type(model).__name__} expects {tuple(placeholder.shape)}"
        )
    stored_quantized = (
        isinstance(module, QuantizedLinear | QuantizedEmbedding) and attr in module.stored_names
    )
    if stored_quantized and attr == SCALE:
        assert isinstance(module, QuantizedLinear | QuantizedEmbedding)
        # (a scale's dtype was checked against verify's before anything was read: ditq.runtime.swap)
        problem = codec_for(module.scheme).scale_problem(tensor)
        if problem is not None:
            raise InputError(f"{entry.path}: tensor {name!r}: {problem}")
        tensor = tensor.to(torch.float32)
    elif stored_quantized and tensor.dtype != placeholder.dtype:
        raise InputError(
            f"{entry.path}: tensor {name!r} is {tensor.dtype}, {type(module).__name__} stores {placeholder.dtype}"
        )
    elif tensor.is_floating_point() and not stored_quantized:
        tensor = tensor.to(torch.float32 if _keep_float32(model, name) else dtype)
    tensor = tensor.to(device)
    if attr in module._parameters:
        module._parameters[attr] = torch.nn.Parameter(tensor, requires_grad=False)
    else:
        module._buffers[attr] = tensor
