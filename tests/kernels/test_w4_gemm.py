"""The 4-bit Triton GEMM against the dequantized weight, grouped and per channel, with a last K tile shorter than the
others: under Triton's interpreter on the CPU (a session with ``TRITON_INTERPRET=1`` and Triton installed), and on a
GPU, where the shipped widening (through float16 bits) must give what the widening by shifts gives."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable

import pytest
import torch

from ditq.checkpoint.codecs import codec_for
from ditq.kernels import w4_triton
from ditq.kernels.registry import get_kernel
from ditq.kernels.w4_triton import (
    W4A8_WIDEN_MIN_ROWS,
    _w4a8_gemm,
    _w4a8_widened_gemm,
    block_k_for,
    cublas_weight_scales,
    repack_int4,
    repack_int4_widened,
    widen_min_rows,
)
from ditq.numerics import relative_l2
from ditq.schemes import W4A16

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
# (M, K, N, groups): groups of 128 and of 32, per channel with K a multiple of the tile, and per channel with a last
# tile of 80 (1104 = 8 x 128 + 80) and one of 96 alone
CASES = [(5, 256, 64, 2), (17, 1024, 64, 32), (33, 384, 48, 1), (20, 1104, 32, 1), (3, 96, 40, 1)]


def _case(
    m: int, k: int, n: int, groups: int, device: torch.device, repack: Callable = repack_int4
) -> tuple[torch.Tensor, dict, torch.Tensor]:
    generator = torch.Generator().manual_seed(m * k + n)
    q = torch.randint(-8, 8, (n, k), generator=generator, dtype=torch.int8)
    scale = torch.rand(n, groups, generator=generator) * 1e-2 + 1e-3
    prepared = repack(codec_for(W4A16).encode(q, scale), device)
    weight = q.to(torch.float64) * scale.to(torch.float64).repeat_interleave(k // groups, dim=1)
    return torch.randn(m, k, generator=generator).to(device), prepared, weight.to(device)


def _fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = x.abs().amax(dim=1) / 448.0
    return (x / scale[:, None]).to(torch.float8_e4m3fn), scale


@pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 and Triton")
@pytest.mark.parametrize(("m", "k", "n", "groups"), CASES)
def test_interpreted_gemm_and_dequantize_match_the_weight(m: int, k: int, n: int, groups: int) -> None:
    from ditq.kernels._triton.w4_gemm import dequantize_int4, w4_gemm

    cpu = torch.device("cpu")
    x, prepared, weight = _case(m, k, n, groups, cpu)
    block_k = block_k_for(k, groups)
    assert block_k is not None
    dequantized = dequantize_int4(prepared["weight"], prepared["weight_scale"], torch.float32)
    assert torch.equal(dequantized, weight.to(torch.float32))
    x_q, x_scale = _fp8_rows(x)
    out = w4_gemm(x_q, x_scale, prepared["weight"], prepared["weight_scale"], None, torch.float32, block_k)
    expected = (x_q.to(torch.float64) * x_scale[:, None].to(torch.float64)) @ weight.T
    assert relative_l2(out, expected) < 1e-6
    x16 = x.to(torch.float16)
    out = w4_gemm(x16, None, prepared["weight"], prepared["weight_scale"], None, torch.float32, block_k)
    assert relative_l2(out, x16.to(torch.float64) @ weight.T) < 1e-6
    # the widened path's scales, (G', N) as cuBLAS takes them, read transposed (strides (1, N)) below its split
    _, widened, _ = _case(m, k, n, groups, cpu, repack_int4_widened)
    assert torch.equal(widened["weight"], prepared["weight"])
    scale_t = widened["weight_scale"].t()
    widened_k = block_k_for(k, scale_t.shape[1])
    assert widened_k is not None
    out = w4_gemm(x_q, x_scale, prepared["weight"], scale_t, None, torch.float32, widened_k)
    assert relative_l2(out, expected) < 1e-6


@pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 and Triton")
@pytest.mark.parametrize(("m", "k", "n", "groups"), CASES)
def test_interpreted_widening_to_e4m3_holds_the_int4_values(m: int, k: int, n: int, groups: int) -> None:
    from ditq.kernels._triton.w4_gemm import widen_int4_fp8

    generator = torch.Generator().manual_seed(k + n)
    q = torch.randint(-8, 8, (n, k), generator=generator, dtype=torch.int8)
    prepared = repack_int4(codec_for(W4A16).encode(q, torch.ones(n, groups)), torch.device("cpu"))
    widened = widen_int4_fp8(prepared["weight"])
    assert widened.dtype == torch.float8_e4m3fn and widened.shape == (n, k)
    assert torch.equal(widened.view(torch.uint8), q.to(torch.float8_e4m3fn).view(torch.uint8))


def _cublas_scaled(
    x_q: torch.Tensor, scale_a: torch.Tensor, q: torch.Tensor, scale_b: torch.Tensor
) -> torch.Tensor:
    """What cuBLAS's fp8 GEMM computes from these scales (float64): rowwise scale_a (M, 1) x scale_b (1, N); 1x128
    blockwise, each 128 of K's dot times scale_a[m, block] x scale_b[block, n]."""
    a, b = x_q.to(torch.float64), q.to(torch.float64)
    if scale_b.shape[0] == 1:
        return (a @ b.T) * scale_a.to(torch.float64) * scale_b.to(torch.float64)
    out = torch.zeros(a.shape[0], b.shape[0], dtype=torch.float64)
    for block in range(scale_b.shape[0]):
        ks = slice(block * 128, (block + 1) * 128)
        part = a[:, ks] @ b[:, ks].T
        out += part * scale_a[:, block, None].to(torch.float64) * scale_b[block][None, :].to(torch.float64)
    return out


@pytest.mark.parametrize(("k", "groups"), [(1104, 1), (1024, 8), (1024, 4), (4096, 2)])
def test_the_scales_handed_to_cublas_weigh_each_k_as_the_checkpoint_does(k: int, groups: int) -> None:
    """Per channel (rowwise), groups of 128, of 256 and of 2048 (repeated over their 128s): the scale layouts
    cuBLAS is handed give the checkpoint's x @ dequant(w)^T, and are the sizes and strides torch._scaled_mm takes."""
    m, n = 6, 48
    generator = torch.Generator().manual_seed(k + groups)
    q = torch.randint(-8, 8, (n, k), generator=generator, dtype=torch.int8)
    scale = torch.rand(n, groups, generator=generator) * 1e-2 + 1e-3
    weight = q.to(torch.float64) * scale.to(torch.float64).repeat_interleave(k // groups, dim=1)
    x_q, x_scale = _fp8_rows(torch.randn(m, k, generator=generator))
    scale_b = cublas_weight_scales(scale, k)
    assert scale_b is not None
    if groups == 1:
        scale_a = x_scale.reshape(m, 1)
        assert scale_b.shape == (1, n)
    else:
        scale_a = x_scale.reshape(1, m).expand(k // 128, m).contiguous().t()
        assert scale_b.shape == (k // 128, n) and scale_b.stride() == (n, 1) and scale_a.stride() == (1, m)
    expected = (x_q.to(torch.float64) * x_scale[:, None].to(torch.float64)) @ weight.T
    assert relative_l2(_cublas_scaled(x_q, scale_a, q, scale_b), expected) < 1e-12
    meta = [t.to("meta") for t in (x_q, q.to(torch.float8_e4m3fn), scale_a, scale_b)]
    assert torch._scaled_mm(meta[0], meta[1].t(), scale_a=meta[2], scale_b=meta[3],
                            out_dtype=torch.bfloat16).shape == (m, n)  # fmt: skip


def test_groupings_cublas_cannot_scale_are_left_to_the_triton_gemm() -> None:
    assert cublas_weight_scales(torch.ones(8, 32), 1024) is None  # groups of 32
    assert cublas_weight_scales(torch.ones(8, 3), 576) is None  # groups of 192
    assert cublas_weight_scales(torch.ones(8, 1), 1000) is None  # K not a multiple of 16
    assert cublas_weight_scales(torch.ones(8, 1), 1008) is not None


@pytest.mark.parametrize(
    ("k", "groups", "rows"), [(1104, 1, 1), (1024, 8, 8), (1024, 4, 8), (1024, 32, 32), (1000, 1, 1)]
)
def test_the_widened_repack_lays_the_scales_out_once_as_cublas_takes_them(
    k: int, groups: int, rows: int
) -> None:
    """Per channel, groups of 128, of 256 (repeated over its 128s), of 32 and a K cuBLAS's fp8 GEMM does not take:
    the widened path's weight_scale is (rows, N), contiguous, cuBLAS's layout where it has one, and weighs every k
    as the checkpoint's scales do; the weight is the plain repack's."""
    n = 24
    _, plain, _ = _case(1, k, n, groups, torch.device("cpu"))
    _, widened, _ = _case(1, k, n, groups, torch.device("cpu"), repack_int4_widened)
    scale = widened["weight_scale"]
    assert torch.equal(widened["weight"], plain["weight"])
    assert scale.shape == (rows, n) and scale.is_contiguous() and scale.dtype == torch.float32
    cublas = cublas_weight_scales(plain["weight_scale"], k)
    assert (cublas is not None) == (k % 16 == 0 and groups in (1, k // 128, k // 256))
    if cublas is not None:
        assert torch.equal(scale, cublas)
    per_k = plain["weight_scale"].repeat_interleave(k // groups, dim=1)
    assert torch.equal(scale.t().repeat_interleave(k // rows, dim=1), per_k)


def test_the_widening_split_follows_the_gemm_s_work() -> None:
    """From 256 tokens at the least, and where M x K x N reaches 2^33: the shapes run 5 timed on each side; a layer
    under 2^22 weights never widens, and the doctor then checks it at one token count."""
    assert widen_min_rows(4096, 12288) == widen_min_rows(12288, 4096) == W4A8_WIDEN_MIN_ROWS == 256
    assert widen_min_rows(4096, 4096) == 512  # Triton at 256 tokens, widened at 1024
    assert widen_min_rows(4096, 1024) == 2048  # Triton at 1024 tokens, widened at 4096
    assert widen_min_rows(4096, 64) is None and widen_min_rows(1024, 256) is None
    path = get_kernel("widen-scaled-mm-w4a8")
    assert path.rows_checked(32, 4096, 4096) == (32, 512)
    assert path.rows_checked(4352, 4096, 1024) == (2047, 4352)
    assert path.rows_checked(32, 4096, 64) == (32,)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    ("m", "k", "n", "groups"),
    [(512, 4096, 1024, 32), (4096, 4096, 512, 16), (600, 4304, 1152, 1), (700, 1024, 256, 32),
     (511, 4096, 1024, 32), (513, 4096, 1024, 32)],
)  # fmt: skip
def test_the_widened_cublas_gemm_gives_what_the_triton_gemm_gives(
    m: int, k: int, n: int, groups: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Groups of 128 and of 256, per channel, groups of 32 (Triton's alone), one token short of the widening and a
    token count cuBLAS's blockwise GEMM does not take (513: the rows padded to a multiple of 4):
    the widen-scaled-mm-w4a8 GEMM against the float64 reference and the Triton GEMM, with a bias. These layers are
    smaller than the shipped split widens (``widen_min_rows``): it is lowered to 512 tokens here."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("cuBLAS's 1x128 blockwise fp8 scaling: sm_90")
    monkeypatch.setattr(w4_triton, "W4A8_WIDEN_MIN_ROWS", 512)
    monkeypatch.setattr(w4_triton, "W4A8_WIDEN_MIN_WORK", 0)
    monkeypatch.setattr(w4_triton, "W4A8_WIDEN_MIN_WEIGHTS", 0)
    cuda = torch.device("cuda")
    x, prepared, weight = _case(m, k, n, groups, cuda)
    _, laid_out, _ = _case(m, k, n, groups, cuda, repack_int4_widened)
    bias = torch.randn(n, device=cuda).to(torch.bfloat16)
    x_q, x_scale = _fp8_rows(x)
    widened = _w4a8_widened_gemm(
        x_q, x_scale, laid_out["weight"], laid_out["weight_scale"], bias, torch.bfloat16
    )
    triton_out = _w4a8_gemm(x_q, x_scale, prepared["weight"], prepared["weight_scale"], bias, torch.bfloat16)
    expected = (x_q.to(torch.float64) * x_scale[:, None].to(torch.float64)) @ weight.T + bias.to(
        torch.float64
    )
    assert widened.dtype == torch.bfloat16 and widened.shape == (m, n)
    assert relative_l2(widened, expected) < 5e-3
    assert relative_l2(widened, triton_out) < 5e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("m", "k", "n", "groups"), [*CASES, (4096, 4096, 1024, 32), (300, 4304, 1152, 1)])
def test_the_float16_bits_widening_gives_what_the_shifts_give(m: int, k: int, n: int, groups: int) -> None:
    from ditq.kernels._triton.w4_gemm import w4_gemm

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 tensor cores: sm_89+")
    cuda = torch.device("cuda")
    x, prepared, weight = _case(m, k, n, groups, cuda)
    block_k = block_k_for(k, groups)
    assert block_k is not None
    x_q, x_scale = _fp8_rows(x)
    outs = [
        w4_gemm(
            x_q,
            x_scale,
            prepared["weight"],
            prepared["weight_scale"],
            None,
            torch.float32,
            block_k,
            magic=magic,
        )
        for magic in (True, False)
    ]
    expected = (x_q.to(torch.float64) * x_scale[:, None].to(torch.float64)) @ weight.T
    for out in outs:
        assert relative_l2(out, expected) < 5e-3
    # the same e4m3 weights into the same dots: the same sums, up to the tile configuration each widening was tuned to
    assert relative_l2(outs[0], outs[1]) < 1e-5
