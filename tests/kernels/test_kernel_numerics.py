"""Every kernel path against an oracle written out here, from the stored weights and the input alone.

The oracle is ``F.linear`` in float64 on the dequantized weight and, for w8a8/fp8, on activations
quantized per token and dequantized, with the arithmetic spelled out in ``oracle`` rather than taken from
ditq. CPU paths run here at tiny sizes; CUDA paths run where a GPU is present.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ditq.checkpoint.codecs import codec_for
from ditq.kernels import KernelPath, all_kernels
from ditq.kernels.stored import analytic_stored
from ditq.numerics import quantize_weight, relative_l2, representable_neighbours
from ditq.schemes import Scheme

# CUDA paths: the doctor's bound (their activation scales may differ from the oracle's by a float32 ulp, which
# moves a value on a rounding boundary by one step). CPU paths compute the stated math in float32, so only the
# output dtype's rounding is left (rel-L2 about a third of its epsilon), and float32's summation order.
CUDA_BOUND = 0.005
CPU_BOUNDS = {torch.bfloat16: 4e-3, torch.float16: 5e-4, torch.float32: 1e-6}
# (x shape (..., K), N, w8a16 group size): CPU sizes stay tiny, with a single token, leading batch dims and
# grouped scales; CUDA sizes include ragged M and the seed's wide-in shape.
CPU_CASES = [((33, 256), 96, None), ((1, 64), 32, None), ((2, 5, 64), 48, None), ((17, 256), 64, 32)]
# grouped scales: w8a16's and the 4-bit schemes' (groups of 128, and 32 from other tools; a handful of tokens, as a
# short prompt or a modulation Linear gives)
CUDA_CASES = [
    ((333, 1024), 768, None),
    ((512, 4096), 4096, None),
    ((64, 12288), 4096, None),
    ((333, 3072), 512, 128),
    ((3, 1024), 256, 32),
    ((65, 1104), 320, None),  # per channel, K not a multiple of 128: the 4-bit GEMM's shorter last tile
]


def _param(path: KernelPath) -> object:
    marks = []
    if path.device_type == "cuda":
        marks = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
    return pytest.param(path, id=path.name, marks=marks)


# the exact paths: a fast-accumulating one is held to the doctor's evidence-derived bound instead
# (tests/kernels/test_fast_accumulation_gpu.py)
PATHS = [_param(p) for p in all_kernels() if not p.name.startswith("test-") and p.accumulate == "exact"]


def _runnable(path: KernelPath, dtype: torch.dtype, k: int, n: int) -> torch.device:
    device = torch.device(path.device_type)
    ok, why = path.supports(device, dtype, k, n)
    if not ok:
        pytest.skip(f"{path.name} cannot run here: {why}")
    return device


def _random_stored(scheme: Scheme, n: int, k: int, seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=generator) * 0.02
    q, scale = quantize_weight(weight, scheme.fitted(k))
    return codec_for(scheme).encode(q, scale), q


def _random_q_scale(
    scheme: Scheme, n: int, k: int, group_size: int | None, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored values drawn directly (not through the quantizer): q (N, K) int8 in [-127, 127] (int4: the whole
    stored range, -8 to 7) or e4m3 up to +-448, scales (N, K / group_size or 1) positive float32."""
    if scheme.weight_type == "int":
        low, high = (
            (-127, 128)
            if scheme.num_bits == 8
            else (-(2 ** (scheme.num_bits - 1)), 2 ** (scheme.num_bits - 1))
        )
        q = torch.randint(low, high, (n, k), generator=generator, dtype=torch.int8)
    else:
        q = (torch.randn(n, k, generator=generator) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    groups = 1 if group_size is None else k // group_size
    return q, torch.rand(n, groups, generator=generator) * 1e-3 + 1e-4


def oracle(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, scheme: Scheme
) -> torch.Tensor:
    """y = x' W^T + b in float64.

    W[n, k] = q[n, k] * scale[n, k // (K / groups)]. For w8a16 x' = x. For w8a8 and fp8 each token (row of
    x, in float32) has s = max|x| / qmax (127 or 448) and x' = round(x / s) * s (int8, clamped to +-127) or
    e4m3(x / s) * s (fp8). The inputs hold no all-zero token.
    """
    k = q.shape[1]
    w = q.to(torch.float64) * scale.to(torch.float64).repeat_interleave(k // scale.shape[1], dim=1)
    x32 = x.to(torch.float32)
    if scheme.activations is None:
        x_used = x32.to(torch.float64)
    else:
        qmax = 127.0 if scheme.activations == "int8" else 448.0
        s = x32.abs().amax(dim=-1, keepdim=True) / qmax
        t = x32 / s
        if scheme.activations == "int8":
            t = t.round().clamp(-127, 127)
        else:
            t = t.to(torch.float8_e4m3fn).to(torch.float32)
        x_used = t.to(torch.float64) * s.to(torch.float64)
    return F.linear(x_used, w, None if bias is None else bias.to(torch.float64))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_matches_an_oracle_written_out_here(path: KernelPath, dtype: torch.dtype) -> None:
    on_cuda = path.device_type == "cuda"
    if on_cuda and dtype == torch.float32:
        pytest.skip("CUDA paths are checked with half-precision activations")
    for index, (x_shape, n, group_size) in enumerate(CUDA_CASES if on_cuda else CPU_CASES):
        if group_size is not None and path.scheme.activations is not None and path.scheme.num_bits == 8:
            continue  # grouped scales: weight-only w8a16's, and the 4-bit schemes'
        k = x_shape[-1]
        device = _runnable(path, dtype, k, n)
        generator = torch.Generator().manual_seed(index)
        q, scale = _random_q_scale(path.scheme, n, k, group_size, generator)
        x = (torch.randn(x_shape, generator=generator) * 3).to(dtype).to(device)
        bias = torch.randn(n, generator=generator).to(dtype).to(device)
        stored = {key: t.to(device) for key, t in codec_for(path.scheme).encode(q, scale).items()}
        out = path.matmul(x, path.prepare(stored, device), bias)
        assert out.shape == (*x_shape[:-1], n) and out.dtype == dtype
        assert torch.isfinite(out).all()
        error = relative_l2(out, oracle(x, q.to(device), scale.to(device), bias, path.scheme))
        bound = CUDA_BOUND if on_cuda else CPU_BOUNDS[dtype]
        assert error <= bound, (
            f"{path.name} {dtype} x{x_shape} N={n} g={group_size}: rel-L2 {error:.2e} > {bound:g}"
        )


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("k", [4096, 4304])
def test_analytic_case_is_exact(path: KernelPath, k: int) -> None:
    """Every output is in_features as the output dtype holds it: 4096 exactly, 4304 (Qwen3-VL's vision MLP, not
    a bfloat16 number) as 4288 or 4320 in bfloat16 and exactly in float16."""
    k, n = (k, 256) if path.device_type == "cuda" else (256 if k == 4096 else k, 48)
    for dtype in sorted(path.activation_dtypes, key=str):
        device = _runnable(path, dtype, k, n)
        stored = {key: t.to(device) for key, t in analytic_stored(path.scheme, n, k).items()}
        out = path.matmul(torch.ones(3, 5, k, dtype=dtype, device=device), path.prepare(stored, device), None)
        assert out.shape == (3, 5, n)
        if dtype == torch.float32:
            torch.testing.assert_close(out, torch.full_like(out, float(k)), rtol=1e-6, atol=0)
            continue
        held = set(representable_neighbours(float(k), dtype))
        assert set(out.unique().tolist()) <= held, (
            f"{path.name} {dtype}: {out.unique()[:5].tolist()} not in {held}"
        )


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
    # Compiled, the per-token quantization runs as torch ops the compiler fuses (eager: the Triton kernel); its
    # division may round a scale one ulp apart, moving a value on a rounding boundary by one quantization step.
    if (
        path.scheme.activations is None
    ):  # weight-only: the same kernel; the compiled gelu may round by a bf16 step
        torch.testing.assert_close(compiled(x), layer(x))
    else:
        # a tenth of the scheme's own quantization error at these sizes (int8 1.3e-2, fp8 3.8e-2 rel-L2 against
        # BF16: kernels_bench); measured on the H200: int8 under 1e-3, fp8 1.2e-3 to 3.1e-3 (its steps are coarser)
        bound = 1e-3 if path.scheme.activations == "int8" else 5e-3
        assert relative_l2(compiled(x), layer(x)) < bound


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_every_activation_quantization_config_gives_the_same_bits(kind: str) -> None:
    """The autotuner may choose any configuration: one tile or several, rows a program, warps; all agree."""
    from ditq.kernels._triton.act_quant import CONFIG_SHAPES, quantize_per_token

    for k in (512, 3000, 4096, 12288):
        x = (torch.randn(37, k, device="cuda") * 4).to(torch.bfloat16)
        x[3] = 0
        first_q, first_scale = quantize_per_token(x, kind, CONFIG_SHAPES[0])
        for config in CONFIG_SHAPES[1:]:
            q, scale = quantize_per_token(x, kind, config)
            assert torch.equal(scale, first_scale), (k, config)
            assert torch.equal(q.view(torch.int8), first_q.view(torch.int8)), (k, config)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("k", [4096, 3000, 12288])  # one tile; tiles with a ragged end; the DiT's MLP width
def test_cuda_activation_quantization_matches_numerics_exactly(kind: str, k: int) -> None:
    from ditq.kernels.cuda_common import quantize_rows
    from ditq.numerics import quantize_activation_per_token

    x = (torch.randn(301, k, device="cuda") * 4).to(torch.bfloat16)  # 301: a last program with spare rows
    x[9, k - 1] = 1000.0  # a row's maximum in its last tile
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
