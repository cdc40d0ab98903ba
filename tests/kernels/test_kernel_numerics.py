"""Every kernel path against the float32 reference from the same dequantized weights.

For w8a8/fp8 the reference quantizes activations the same way (per token,
ditq.numerics). CPU paths run here; CUDA paths run where a GPU is present.
"""

from __future__ import annotations

import pytest
import torch

from ditq.checkpoint.codecs import codec_for
from ditq.kernels import KernelPath, all_kernels
from ditq.kernels.reference import reference_float32
from ditq.kernels.stored import analytic_stored
from ditq.numerics import quantize_weight, relative_l2
from ditq.schemes import Scheme

REL_L2_BOUND = 0.005
# (M, K, N): CPU sizes stay tiny; CUDA sizes include ragged M and the seed's wide-in shape.
CPU_SHAPES = [(33, 256, 96), (1, 64, 32)]
CUDA_SHAPES = [(333, 1024, 768), (512, 4096, 4096), (64, 12288, 4096)]


def _param(path: KernelPath) -> object:
    marks = []
    if path.device_type == "cuda":
        marks = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
    return pytest.param(path, id=path.name, marks=marks)


PATHS = [_param(p) for p in all_kernels() if not p.name.startswith("test-")]


def _runnable(path: KernelPath, dtype: torch.dtype, k: int, n: int) -> torch.device:
    device = torch.device(path.device_type)
    ok, why = path.supports(device, dtype, k, n)
    if not ok:
        pytest.skip(f"{path.name} cannot run here: {why}")
    return device


def _random_stored(scheme: Scheme, n: int, k: int, seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=generator) * 0.02
    q, scale = quantize_weight(weight, scheme)
    return codec_for(scheme).encode(q, scale), q


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_float32_reference(path: KernelPath, dtype: torch.dtype) -> None:
    shapes = CUDA_SHAPES if path.device_type == "cuda" else CPU_SHAPES
    for index, (m, k, n) in enumerate(shapes):
        device = _runnable(path, dtype, k, n)
        stored, q = _random_stored(path.scheme, n, k, seed=index)
        generator = torch.Generator().manual_seed(100 + index)
        x = (torch.randn(m, k, generator=generator) * 3).to(dtype).to(device)
        bias = torch.randn(n, generator=generator).to(dtype).to(device)
        prepared = path.prepare({key: t.to(device) for key, t in stored.items()}, device)
        out = path.matmul(x, prepared, bias)
        ref = reference_float32(
            x, q.to(device), stored["weight_scale"].to(device), bias, path.scheme.activations
        )
        assert out.shape == (m, n) and out.dtype == dtype
        assert torch.isfinite(out).all()
        error = relative_l2(out, ref)
        assert error <= REL_L2_BOUND, f"{path.name} {dtype} (M,K,N)={(m, k, n)}: rel-L2 {error:.2e}"


@pytest.mark.parametrize("path", PATHS)
def test_analytic_case_is_exact(path: KernelPath) -> None:
    k, n = (4096, 256) if path.device_type == "cuda" else (256, 48)
    for dtype in sorted(path.activation_dtypes, key=str):
        device = _runnable(path, dtype, k, n)
        stored = {key: t.to(device) for key, t in analytic_stored(path.scheme, n, k).items()}
        out = path.matmul(torch.ones(3, 5, k, dtype=dtype, device=device), path.prepare(stored, device), None)
        assert out.shape == (3, 5, n)
        # in_features is a power of two: exactly representable in every activation dtype.
        expected = torch.full_like(out, float(k))
        if dtype == torch.float32:
            torch.testing.assert_close(out, expected, rtol=1e-6, atol=0)
        else:
            assert torch.equal(out, expected), f"{path.name} {dtype}: {out.unique()[:5].tolist()}"


@pytest.mark.parametrize("path", PATHS)
def test_torch_compile_traces_without_graph_breaks(path: KernelPath) -> None:
    k, n = (1024, 512) if path.device_type == "cuda" else (64, 32)
    device = _runnable(path, torch.bfloat16, k, n)
    stored, _ = _random_stored(path.scheme, n, k, seed=7)
    prepared = path.prepare({key: t.to(device) for key, t in stored.items()}, device)
    x = torch.randn(2, 17, k, device=device).to(torch.bfloat16)
    bias = torch.randn(n, device=device).to(torch.bfloat16)

    def layer(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(path.matmul(x, prepared, bias))

    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)  # a graph break would raise here
    # The kernel output is the same; the compiled gelu may round differently by one bf16 step.
    torch.testing.assert_close(compiled(x), layer(x))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_cuda_activation_quantization_matches_numerics_exactly(kind: str) -> None:
    from ditq.kernels.cuda_common import quantize_rows
    from ditq.numerics import quantize_activation_per_token

    x = (torch.randn(300, 4096, device="cuda") * 4).to(torch.bfloat16)
    x[7] = 0  # an all-zero token: scale clamps to 1e-12 / qmax, q = 0
    q, scale = quantize_rows(x, kind)
    q_ref, scale_ref = quantize_activation_per_token(x, kind)
    # torch's CUDA division by a scalar multiplies by its reciprocal: scales may differ by one float32 ulp,
    # which can move a value that sits on a rounding boundary by one quantization step.
    torch.testing.assert_close(scale, scale_ref, rtol=2**-23, atol=0)
    moved = q.to(torch.float32) != q_ref.to(torch.float32)
    assert moved.float().mean() < 1e-3
    step = 1.0 if kind == "int8" else 32.0  # fp8 e4m3 spacing at its largest binade
    assert ((q.to(torch.float32) - q_ref.to(torch.float32)).abs() <= step).all()
