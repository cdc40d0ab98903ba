"""The 4-bit Triton GEMM against the dequantized weight, grouped and per channel, with a last K tile shorter than the
others: under Triton's interpreter on the CPU (a session with ``TRITON_INTERPRET=1`` and Triton installed), and on a
GPU, where the shipped widening (through float16 bits) must give what the widening by shifts gives."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from ditq.checkpoint.codecs import codec_for
from ditq.kernels.w4_triton import block_k_for, repack_int4
from ditq.numerics import relative_l2
from ditq.schemes import W4A16

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
# (M, K, N, groups): groups of 128 and of 32, per channel with K a multiple of the tile, and per channel with a last
# tile of 80 (1104 = 8 x 128 + 80) and one of 96 alone
CASES = [(5, 256, 64, 2), (17, 1024, 64, 32), (33, 384, 48, 1), (20, 1104, 32, 1), (3, 96, 40, 1)]


def _case(
    m: int, k: int, n: int, groups: int, device: torch.device
) -> tuple[torch.Tensor, dict, torch.Tensor]:
    generator = torch.Generator().manual_seed(m * k + n)
    q = torch.randint(-8, 8, (n, k), generator=generator, dtype=torch.int8)
    scale = torch.rand(n, groups, generator=generator) * 1e-2 + 1e-3
    prepared = repack_int4(codec_for(W4A16).encode(q, scale), device)
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
