"""The quantizer's CUDA path: same artifact layout as the CPU path, and numerically the same encoding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ditq
from ditq.numerics import unpack_int32_to_int

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("scheme", ["w8a16", "w8a8", "fp8"])
def test_cuda_quantize_matches_cpu(model_dir, tmp_path: Path, scheme: str) -> None:  # type: ignore[no-untyped-def]
    source = model_dir("qwenimage21")
    on_cpu = ditq.quantize(source, tmp_path / "cpu", scheme, device="cpu")
    on_cuda = ditq.quantize(source, tmp_path / "cuda", scheme, device="cuda")
    assert (
        on_cuda.manifest["statistics"]["quantized_tensors"]
        == on_cpu.manifest["statistics"]["quantized_tensors"]
    )
    cpu_tensors: dict[str, torch.Tensor] = {}
    cuda_tensors: dict[str, torch.Tensor] = {}
    for path in sorted((tmp_path / "cpu" / "transformer").glob("*.safetensors")):
        cpu_tensors.update(load_file(str(path)))
    for path in sorted((tmp_path / "cuda" / "transformer").glob("*.safetensors")):
        cuda_tensors.update(load_file(str(path)))
    assert cpu_tensors.keys() == cuda_tensors.keys()
    for name, expected in cpu_tensors.items():
        actual = cuda_tensors[name]
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, name
        if name.endswith("weight_scale"):
            torch.testing.assert_close(actual, expected, rtol=1e-6, atol=0.0)
        elif name.endswith("weight_packed"):
            shape = tuple(cpu_tensors[name.replace("weight_packed", "weight_shape")].tolist())
            _assert_one_step_apart(
                unpack_int32_to_int(actual, shape), unpack_int32_to_int(expected, shape), name
            )
        elif actual.dtype in (torch.int8, torch.float8_e4m3fn):
            _assert_one_step_apart(actual, expected, name)
        else:
            assert torch.equal(actual, expected), name


def _assert_one_step_apart(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    """A value exactly between two representable ones may round the other way when the device's division
    differs by one ulp; a difference of more than one step, or in more than 1 % of values, is a real one."""
    a, e = actual.float(), expected.float()
    differ = a != e
    assert differ.float().mean().item() < 0.01, f"{name}: {differ.float().mean().item():.2%} of values differ"
    if expected.dtype == torch.int8:
        step = torch.ones_like(e)
    else:  # e4m3: 3 mantissa bits, so neighbours are 1/8 of the magnitude's power of two apart
        step = torch.exp2(torch.floor(torch.log2(e.abs().clamp_min(2.0**-6)))) / 8
    assert ((a - e).abs() <= step).all(), f"{name}: values more than one quantization step apart"
