"""Loading a mixed-precision artifact (``quantize --plan``): each Linear gets its own scheme's module class, and
the whole transformer's forward equals an oracle written out here: the float32 source model whose planned
Linears hold the weights compressed-tensors decodes, their inputs quantized per token as each scheme says.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from tiny_models import MIXED_FLUX_LAYERS, example_inputs

from ditq.checkpoint.reference import ReferenceDecoder
from ditq.numerics import relative_l2
from ditq.runtime.loader import load_component, stored_layer_schemes
from ditq.runtime.modules import quantized_linear_class, quantized_linears

# The oracle runs the same arithmetic in float32 (the CPU reference paths); what remains is summation order.
SAME_MATH_BOUND = 1e-5
QMAX = {"w8a8": 127.0, "fp8": 448.0}  # per-token activation range; w8a16 leaves activations as they are


class _Oracle(torch.nn.Module):
    """A Linear whose weight is ``weight`` and whose input is fake-quantized per token as ``scheme`` says."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, scheme: str) -> None:
        super().__init__()
        self.weight, self.bias, self.scheme = weight, bias, scheme

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        if self.scheme in QMAX:
            scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / QMAX[self.scheme]
            scaled = x / scale
            if self.scheme == "w8a8":  # int8: round to nearest, saturate
                x = scaled.round().clamp(-128, 127) * scale
            else:  # e4m3: saturate, then round to the nearest representable value
                x = scaled.clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
        return torch.nn.functional.linear(x, self.weight, self.bias)


def _source(source: Path) -> torch.nn.Module:
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel.from_pretrained(
        str(source / "transformer"), torch_dtype=torch.float32
    ).eval()


def _oracle(source: Path, artifact: Path) -> torch.nn.Module:
    model = _source(source)
    stored = load_file(str(artifact / "transformer/diffusion_pytorch_model.safetensors"))
    qconfig: dict[str, Any] = json.loads((artifact / "transformer/config.json").read_text())
    decoder = ReferenceDecoder(qconfig["quantization_config"])
    for name, scheme in MIXED_FLUX_LAYERS.items():
        if scheme == "keep":
            continue
        linear = model.get_submodule(name)
        tensors = {k.rpartition(".")[2]: v for k, v in stored.items() if k.rpartition(".")[0] == name}
        weight = decoder.decode(tensors, name, linear).float()
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, _Oracle(weight, linear.bias, scheme))
    return model


def test_each_layer_gets_its_schemes_class_and_the_forward_matches(
    mixed_artifact: tuple[Path, Path, Path],
) -> None:
    source, artifact, _ = mixed_artifact
    model = load_component(artifact, "transformer", dtype=torch.float32)
    planned = {name: scheme for name, scheme in MIXED_FLUX_LAYERS.items() if scheme != "keep"}
    layers = quantized_linears(model)
    assert {name: type(layer) for name, layer in layers.items()} == {
        name: quantized_linear_class(scheme) for name, scheme in planned.items()
    }
    assert {n: s.name for n, s in stored_layer_schemes(artifact, "transformer").items()} == planned
    for name in ("single_transformer_blocks.0.proj_out", "transformer_blocks.0.attn.add_q_proj"):  # keep
        assert type(model.get_submodule(name)) is torch.nn.Linear
    inputs = example_inputs("flux", model)
    with torch.no_grad():
        ours = model(**inputs)[0]
        expected = _oracle(source, artifact)(**inputs)[0]
        unquantized = _source(source)(**inputs)[0]
    assert {layer.kernel.name for layer in layers.values() if layer.kernel is not None} == {
        "cpu-reference-w8a16",
        "cpu-reference-w8a8",
        "cpu-reference-fp8",
    }
    assert relative_l2(ours, expected) < SAME_MATH_BOUND  # measured 0: the same float32 arithmetic
    assert relative_l2(ours, unquantized) > 1e-3  # and the quantization shows
