"""GPTQ (ditq.quantization.gptq) on the CPU, small and seeded: its format, its agreement with round-to-nearest where
the inputs are uncorrelated, its gain over it where they are not, and the Hessian it is given."""

from __future__ import annotations

import math

import pytest
import torch

from ditq.numerics import dequantize_weight as dequantize
from ditq.numerics import quantize_weight
from ditq.quantization.gptq import HessianAccumulator, gptq_quantize, hessian_hooks
from ditq.schemes import W4A16


def rtn_quantize(weight: torch.Tensor, group_size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """ditq's round to nearest at 4 bits (what ``--calibrate rtn`` stores)."""
    return quantize_weight(weight, W4A16.with_group_size(group_size))


def _correlated(samples: int, in_features: int, seed: int) -> torch.Tensor:
    """X = Z @ A (samples, K): Gaussian rows mixed by a random A, so the input features are correlated."""
    generator = torch.Generator().manual_seed(seed)
    z = torch.randn(samples, in_features, generator=generator)
    mixing = torch.randn(in_features, in_features, generator=generator) / in_features**0.5
    return z @ mixing


def _hessian(x: torch.Tensor) -> torch.Tensor:
    return 2.0 / x.shape[0] * x.T @ x


def _reference_gptq(
    weight: torch.Tensor, hessian: torch.Tensor, bits: int, group_size: int, damp: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unblocked GPTQ, column by column in float64 with each update applied at once (no lazy blocks): the
    algorithm the module's blocked form must match."""
    qmax = 2 ** (bits - 1) - 1
    w = weight.to(torch.float64).clone()
    h = hessian.to(torch.float64).clone()
    h.diagonal().add_(damp * h.diagonal().mean())
    h_inv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.zeros_like(w)
    scales = []
    for column in range(w.shape[1]):
        if column % group_size == 0:
            scales.append(w[:, column : column + group_size].abs().amax(dim=1).clamp_min(1e-12) / qmax)
        q[:, column] = (w[:, column] / scales[-1]).round().clamp(-qmax - 1, qmax)
        error = (w[:, column] - q[:, column] * scales[-1]) / h_inv[column, column]
        w[:, column:] -= error.unsqueeze(1) * h_inv[column, column:].unsqueeze(0)
    return q.to(torch.int8), torch.stack(scales, dim=1).to(torch.float32)


@pytest.mark.parametrize(("bits", "group_size"), [(4, 32), (4, None), (3, 16), (8, 64)])
def test_gptq_returns_int8_in_range_with_one_scale_per_group(bits: int, group_size: int | None) -> None:
    weight = torch.randn(48, 128, generator=torch.Generator().manual_seed(0))
    x = _correlated(512, 128, seed=1)
    q, scale = gptq_quantize(weight, _hessian(x), bits=bits, group_size=group_size)
    assert q.dtype == torch.int8 and q.shape == (48, 128)
    assert int(q.min()) >= -(2 ** (bits - 1)) and int(q.max()) <= 2 ** (bits - 1) - 1
    assert scale.dtype == torch.float32
    assert scale.shape == (48, 1 if group_size is None else 128 // group_size)
    assert bool((scale > 0).all())
    assert dequantize(q, scale).shape == (48, 128)


def test_gptq_equals_rtn_when_the_inputs_are_uncorrelated() -> None:
    """H = I (plus damping): the inverse Hessian is diagonal, so no column's error reaches another, and GPTQ
    rounds exactly as round-to-nearest does, scales included."""
    weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(2))
    for group_size in (32, 128, None):
        q, scale = gptq_quantize(weight, torch.eye(256), bits=4, group_size=group_size, block_size=48)
        q_rtn, scale_rtn = rtn_quantize(weight, group_size)
        assert torch.equal(q, q_rtn)
        assert torch.equal(scale, scale_rtn)


def test_gptq_cuts_the_output_error_of_rtn_on_correlated_inputs() -> None:
    x = _correlated(2048, 128, seed=3)
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(4))
    reference = x @ weight.T
    q, scale = gptq_quantize(weight, _hessian(x), bits=4, group_size=32)
    gptq_error = float((reference - x @ dequantize(q, scale).T).norm())
    q_rtn, scale_rtn = rtn_quantize(weight, 32)
    rtn_error = float((reference - x @ dequantize(q_rtn, scale_rtn).T).norm())
    print(
        f"||X W^T - X Wq^T||: GPTQ {gptq_error:.4f}, RTN {rtn_error:.4f} ({gptq_error / rtn_error:.3f} of RTN)"
    )
    assert gptq_error <= 0.8 * rtn_error


@pytest.mark.parametrize("block_size", [128, 32, 20, 7])
def test_blocked_gptq_matches_the_unblocked_algorithm(block_size: int) -> None:
    """Lazy block updates change only the order of the arithmetic, block sizes that cut groups in two included
    (a group's scale reads the columns past the block with this block's errors applied)."""
    x = _correlated(1024, 96, seed=5)
    weight = torch.randn(40, 96, generator=torch.Generator().manual_seed(6))
    q, scale = gptq_quantize(weight, _hessian(x), bits=4, group_size=32, block_size=block_size)
    q_ref, scale_ref = _reference_gptq(weight, _hessian(x), bits=4, group_size=32, damp=0.01)
    assert torch.allclose(scale, scale_ref, rtol=1e-4, atol=0)
    assert int((q != q_ref).sum()) <= 2  # a float32 rounding tie may land either way, out of 3840 values


def test_dead_columns_are_zeroed_and_the_inputs_left_alone() -> None:
    x = _correlated(512, 64, seed=7)
    x[:, [3, 40]] = 0.0
    hessian = _hessian(x)
    weight = torch.randn(16, 64, generator=torch.Generator().manual_seed(8))
    weight_before, hessian_before = weight.clone(), hessian.clone()
    q, scale = gptq_quantize(weight, hessian, bits=4, group_size=16)
    assert bool((q[:, [3, 40]] == 0).all())
    assert bool(torch.isfinite(scale).all())
    assert torch.equal(weight, weight_before) and torch.equal(hessian, hessian_before)


def test_an_all_zero_weight_quantizes_to_zeros() -> None:
    q, scale = gptq_quantize(torch.zeros(8, 64), _hessian(_correlated(256, 64, seed=9)), group_size=32)
    assert bool((q == 0).all()) and bool(torch.isfinite(scale).all())
    assert bool((dequantize(q, scale) == 0).all())


def test_hessian_accumulator_is_two_over_n_x_transpose_x_however_it_is_fed() -> None:
    x = _correlated(300, 32, seed=11)
    whole = HessianAccumulator(32)
    whole.add(x)
    parts = HessianAccumulator(32)
    parts.add(x[:100].reshape(4, 25, 32))  # (..., K): every row counts as a sample
    parts.add(x[100:])
    parts.add(x[:0])
    assert whole.samples == parts.samples == 300
    assert whole.hessian.shape == (32, 32) and whole.hessian.dtype == torch.float32
    assert torch.allclose(whole.hessian, parts.hessian, rtol=1e-5, atol=1e-6)
    assert torch.allclose(whole.hessian, _hessian(x), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"\(\.\.\., 32\)"):
        whole.add(torch.zeros(4, 31))


def test_rows_with_a_nan_or_an_infinity_are_left_out_of_the_hessian_and_counted() -> None:
    """Rows a request computed as NaN (the tiny Qwen-Image pipeline's image tokens at one denoising step) left out:
    the Hessian is the finite rows' own, where one such row made all of it NaN."""
    x = _correlated(300, 32, seed=12)
    bad = x.clone()
    bad[7, 3], bad[100] = math.nan, math.inf
    bad[200, 0], bad[200, 1] = math.inf, -math.inf  # a row whose values would cancel to NaN in a sum
    kept = torch.ones(300, dtype=torch.bool)
    kept[[7, 100, 200]] = False
    accumulator = HessianAccumulator(32)
    accumulator.add(bad[:150])
    accumulator.add(bad[150:].reshape(3, 50, 32))
    assert (accumulator.samples, accumulator.dropped) == (297, 3)
    assert bool(torch.isfinite(accumulator.hessian).all())
    assert torch.allclose(accumulator.hessian, _hessian(x[kept]), rtol=1e-5, atol=1e-6)
    clean = HessianAccumulator(32)
    clean.add(x)
    assert (clean.samples, clean.dropped) == (300, 0)


def test_hessian_hooks_collect_the_named_layers_only_and_are_removed() -> None:
    torch.manual_seed(12)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8), torch.nn.Linear(8, 4)
    )
    batches = [torch.randn(5, 16), torch.randn(2, 3, 16)]
    with hessian_hooks(model, ["0", "2", "0"]) as accumulators:
        for batch in batches:
            model(batch)
    assert sorted(accumulators) == ["0", "2"]
    assert accumulators["0"].samples == accumulators["2"].samples == 11
    assert accumulators["2"].hessian.shape == (32, 32)
    rows = torch.cat([batch.reshape(-1, 16) for batch in batches])
    assert torch.allclose(accumulators["0"].hessian, _hessian(rows), rtol=1e-5, atol=1e-6)
    assert all(not layer._forward_pre_hooks for layer in model.modules())
    model(batches[0])
    assert accumulators["0"].samples == 11


def test_hessian_hooks_are_removed_when_the_block_raises_and_refuse_a_non_linear() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    with pytest.raises(RuntimeError, match="boom"), hessian_hooks(model, ["0"]):
        raise RuntimeError("boom")
    assert not model[0]._forward_pre_hooks
    with pytest.raises(ValueError, match="in_features"), hessian_hooks(model, ["1"]):
        pass
    with pytest.raises(ValueError, match="'5'"), hessian_hooks(model, ["5"]):
        pass
    assert all(not layer._forward_pre_hooks for layer in model.modules())


def test_bad_shapes_and_formats_are_refused() -> None:
    hessian = torch.eye(100)
    with pytest.raises(ValueError, match=r"100.*32|32.*100"):
        gptq_quantize(torch.zeros(8, 100), hessian, group_size=32)
    with pytest.raises(ValueError, match="2-D"):
        gptq_quantize(torch.zeros(2, 8, 100), hessian)
    with pytest.raises(ValueError, match="Hessian has shape"):
        gptq_quantize(torch.zeros(8, 64), torch.eye(32), group_size=32)
    with pytest.raises(ValueError, match="bits"):
        gptq_quantize(torch.zeros(8, 64), torch.eye(64), bits=1, group_size=32)


def test_a_hessian_without_a_cholesky_factor_asks_for_more_damping() -> None:
    with pytest.raises(ValueError, match="larger damp"):
        gptq_quantize(torch.randn(8, 64), -torch.eye(64), group_size=32)


def test_act_order_keeps_the_given_scales_and_equals_rtn_where_no_error_travels() -> None:
    """With a diagonal Hessian of unequal energies, act order changes the order but no column's error reaches
    another: round to nearest exactly, its scales the given weights' (static groups)."""
    weight = torch.randn(32, 128, generator=torch.Generator().manual_seed(11))
    hessian = torch.diag(torch.linspace(0.1, 5.0, 128))
    q, scale = gptq_quantize(weight, hessian, bits=4, group_size=32, act_order=True, block_size=40)
    q_rtn, scale_rtn = rtn_quantize(weight, 32)
    assert torch.equal(q, q_rtn) and torch.equal(scale, scale_rtn)


def test_act_order_cuts_the_error_further_where_input_energies_differ() -> None:
    generator = torch.Generator().manual_seed(12)
    x = _correlated(4096, 128, seed=13) * torch.logspace(-1, 1, 128)[torch.randperm(128, generator=generator)]
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(14))
    reference = x @ weight.T

    def error(**kwargs: object) -> float:
        q, scale = gptq_quantize(weight, _hessian(x), bits=4, group_size=32, **kwargs)  # type: ignore[arg-type]
        return float((reference - x @ dequantize(q, scale).T).norm())

    in_order, by_energy = error(), error(act_order=True)
    print(f"||X W^T - X Wq^T||: columns in order {in_order:.3f}, act order {by_energy:.3f}")
    assert by_energy < in_order


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_host_accumulator_fed_on_cuda_sums_what_one_on_the_host_sums() -> None:
    """Inputs on CUDA into a host accumulator: each product made on the device a chunk of rows at a time (more rows
    than one chunk here), taken over through the pinned buffer, which the hooks let go."""
    from ditq.quantization import gptq

    x = _correlated(gptq.PRODUCT_ROWS + 300, 64, seed=12)
    on_host, fed_on_cuda = HessianAccumulator(64), HessianAccumulator(64, device="cpu")
    for part in (x[:500], x[500:]):
        on_host.add(part)
        fed_on_cuda.add(part.cuda())
    assert fed_on_cuda.hessian.device.type == "cpu" and fed_on_cuda.samples == on_host.samples == x.shape[0]
    assert torch.allclose(fed_on_cuda.hessian, on_host.hessian, rtol=1e-4, atol=1e-5)
    layer = torch.nn.Linear(64, 8).cuda()
    with hessian_hooks(layer, [""], device="cpu") as found:
        layer(x.cuda())
    assert found[""].hessian.device.type == "cpu" and not gptq._STAGING
    assert torch.allclose(found[""].hessian, _hessian(x), rtol=1e-4, atol=1e-5)
    # bfloat16 inputs go into the float32 product as they are (out_dtype): what their float32 copies sum to
    half = x.to(torch.bfloat16)
    from_half = HessianAccumulator(64, device="cpu")
    from_half.add(half.cuda())
    assert not gptq._NO_OUT_DTYPE, "this torch has no addmm(out_dtype=) on CUDA"
    assert torch.allclose(from_half.hessian, _hessian(half.float()), rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    ("out_features", "in_features", "group_size"),
    # four whole blocks; a short last block; one scale a row, over rows that end inside a program's
    [(96, 512, 128), (40, 200, 8), (300, 384, None)],
)
def test_the_triton_sweep_on_cuda_rounds_as_the_torch_loop_does(
    out_features: int, in_features: int, group_size: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Act order on CUDA runs gptq_triton's one-launch-a-block sweep: the torch loop's codes bit for bit (both
    round once an operation, the kernel compiled without contraction), and the CPU's output error to within a
    percent (CUDA's matmuls round differently from the CPU's)."""
    from ditq.quantization import gptq

    x = _correlated(4 * in_features, in_features, seed=out_features)
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(5)) * 0.02
    hessian = _hessian(x)
    assert gptq._triton_sweeps(weight.cuda(), gptq.BLOCK_SIZE), "Triton is not installed with this CUDA torch"
    kwargs = {"bits": 4, "group_size": group_size, "act_order": True}
    q_triton, s_triton = gptq_quantize(weight.cuda(), hessian.cuda(), **kwargs)  # type: ignore[arg-type]
    monkeypatch.setattr(gptq, "_triton_sweeps", lambda w, block_size: False)
    q_loop, s_loop = gptq_quantize(weight.cuda(), hessian.cuda(), **kwargs)  # type: ignore[arg-type]
    assert q_triton.device.type == "cuda" and q_triton.dtype == torch.int8
    assert torch.equal(q_triton, q_loop) and torch.equal(s_triton, s_loop)
    q_cpu, s_cpu = gptq_quantize(weight, hessian, **kwargs)  # type: ignore[arg-type]

    def output_error(q: torch.Tensor, scale: torch.Tensor) -> float:
        return float((x @ (weight - dequantize(q.cpu(), scale.cpu())).T).norm() / (x @ weight.T).norm())

    on_cuda, on_cpu = output_error(q_triton, s_triton), output_error(q_cpu, s_cpu)
    rtn = output_error(*rtn_quantize(weight, group_size))
    assert abs(on_cuda - on_cpu) < 0.01 * on_cpu and on_cuda < rtn
