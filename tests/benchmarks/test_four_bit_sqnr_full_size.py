"""benchmarks/four_bit_sqnr_full_size.py: its two shortcuts give what ditq's own calls give (one GPTQ call for a
weight and its residuals, the rank-R branches from one SVD), and GPTQ's output SQNR on its own calibration inputs is
at least round to nearest's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from ditq.numerics import dequantize_weight
from ditq.quantization.gptq import HessianAccumulator, gptq_quantize
from ditq.quantization.low_rank import split_low_rank
from ditq.schemes import CHANNEL, get_scheme

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from four_bit_sqnr_full_size import SHIPPED, SqnrOptions, gptq_rows, low_rank_branches, measure_layer

OUT_FEATURES, IN_FEATURES, ROWS = 48, 256, 512


def _layer(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A weight (N, K), correlated inputs with uneven channel scales (rows, K) and their Hessian (K, K)."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(OUT_FEATURES, IN_FEATURES, generator=generator) * 0.02
    mixing = torch.randn(IN_FEATURES, IN_FEATURES, generator=generator) / IN_FEATURES**0.5
    scales = torch.logspace(-1, 1, IN_FEATURES)[torch.randperm(IN_FEATURES, generator=generator)]
    inputs = (
        torch.randn(ROWS, IN_FEATURES, generator=generator) @ (torch.eye(IN_FEATURES) + mixing)
    ) * scales
    accumulator = HessianAccumulator(IN_FEATURES)
    accumulator.add(inputs)
    return weight, inputs, accumulator.hessian


@pytest.mark.parametrize("group_size", [128, CHANNEL])
def test_one_gptq_call_for_stacked_weights_rounds_each_as_its_own_call(group_size: object) -> None:
    weight, _, hessian = _layer()
    scheme = get_scheme("w4a16", group_size)  # type: ignore[arg-type]
    others = [weight * 0.5, weight.flip(0)]
    stacked = gptq_rows([weight, *others], hessian, scheme)
    for values, got in zip([weight, *others], stacked, strict=True):
        q, scale = gptq_quantize(
            values,
            hessian,
            bits=4,
            group_size=scheme.group_size,
            damp=SHIPPED.damp,
            act_order=SHIPPED.act_order,
        )
        assert torch.equal(got, dequantize_weight(q, scale))


def test_the_branches_from_one_svd_are_split_low_rank_at_each_rank() -> None:
    weight, _, _ = _layer()
    for rank, got in low_rank_branches(weight, (8, 16)).items():
        expected = split_low_rank(weight, rank)
        assert torch.equal(got.up, expected.up) and torch.equal(got.down, expected.down)
        torch.testing.assert_close(got.residual, expected.residual, rtol=0, atol=1e-7)


def test_gptq_beats_round_to_nearest_on_its_own_calibration_inputs() -> None:
    weight, inputs, hessian = _layer(seed=1)
    layer = measure_layer(weight, hessian, inputs, SqnrOptions(preset="tiny", ranks=(8,)))
    for group_key in ("128", CHANNEL):
        rows = layer[group_key]["rows"]
        assert rows.keys() == {"rtn", "rtn-lr8", "gptq", "gptq-lr8"}
        for suffix in ("", "-lr8"):
            nearest, calibrated = rows[f"rtn{suffix}"], rows[f"gptq{suffix}"]
            assert calibrated["output_sqnr_db"] >= nearest["output_sqnr_db"] + 1.0, (group_key, rows)
        assert layer[group_key]["gains_db"]["gptq_over_rtn"] >= 1.0
