"""Sensitivity on real classes: one Linear quantized in memory computes the stored math; the workbench replays the
component's recorded calls exactly and measures each unit's error on the tiny demo pipeline."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ditq.judge.compare import PSNR_CAP_DB
from ditq.plan.sensitivity import Unit, Workbench, layers_quantized, measure_sensitivity, quantized_copy
from ditq.probe.fixtures import load_fixtures
from ditq.probe.runner import describe_run
from ditq.quantization.plan_file import KEEP
from ditq.runfiles import InProcessOptions
from ditq.runtime.modules import QuantizedLinear

SCHEMES = ("fp8", "w8a8", "w8a16")


def _expected(linear: torch.nn.Linear, x: torch.Tensor, scheme: str) -> torch.Tensor:
    """The stored math written out: symmetric per-output-channel weights; w8a8/fp8 also quantize each token."""
    w = linear.weight.detach().float()
    qmax = 448.0 if scheme == "fp8" else 127.0
    w_scale = w.abs().amax(dim=1, keepdim=True) / qmax
    if scheme == "fp8":
        w_q = (w / w_scale).to(torch.float8_e4m3fn).float()
    else:
        w_q = (w / w_scale).round().clamp(-127, 127)
    x_used = x
    if scheme != "w8a16":
        x_scale = x.abs().amax(dim=-1, keepdim=True) / qmax
        scaled = x / x_scale
        x_q = scaled.to(torch.float8_e4m3fn).float() if scheme == "fp8" else scaled.round().clamp(-128, 127)
        x_used = x_q * x_scale
    return x_used @ (w_q * w_scale).t() + linear.bias.detach()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_quantized_copy_computes_the_stored_math(scheme: str):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48)
    x = torch.randn(5, 64)
    copy = quantized_copy(linear, scheme)
    assert isinstance(copy, QuantizedLinear) and copy.scheme.name == scheme
    with torch.no_grad():
        got, exact = copy(x), linear(x)
        expected = _expected(linear, x, scheme)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    error = float((got - exact).norm() / exact.norm())
    assert 0 < error < (0.08 if scheme == "fp8" else 0.03)


def test_layers_are_swapped_inside_and_the_originals_restored_after_an_error():
    from ditq.demo import build_tiny_pipeline

    transformer = build_tiny_pipeline(seed=0).transformer
    names = ["transformer_blocks.0.attn.to_q", "transformer_blocks.1.img_mlp.out"]
    originals = [transformer.get_submodule(n) for n in names]
    with (
        pytest.raises(RuntimeError, match="inside"),
        layers_quantized(transformer, {names[0]: "fp8", names[1]: KEEP}),
    ):
        assert isinstance(transformer.get_submodule(names[0]), QuantizedLinear)
        assert transformer.get_submodule(names[1]) is originals[1]  # keep: untouched
        raise RuntimeError("inside")
    assert [transformer.get_submodule(n) for n in names] == originals


@pytest.fixture(scope="module")
def bench(tiny_workspace: Path, tmp_path_factory: pytest.TempPathFactory) -> Workbench:
    from ditq.pipeline.open import load_pipeline

    pipeline = load_pipeline(tiny_workspace / "model", device="cpu", dtype=torch.float32)
    fixtures = load_fixtures(tiny_workspace / "fixtures.json", tiny_workspace / "refs")
    workbench = Workbench(pipeline, "transformer", fixtures, 3, 1.0, [1, 2], [1], proxy_steps=2)
    description = describe_run(
        "baseline",
        ["in-process"],
        tiny_workspace / "fixtures.json",
        tiny_workspace / "refs",
        fixtures,
        [1, 2],
        3,
        1.0,
        InProcessOptions(device="cpu", offload="none"),
        tiny_workspace / "model",
    )
    workbench.run_reference(tmp_path_factory.mktemp("reference"), description)
    return workbench


def test_the_replay_reproduces_the_recorded_outputs(bench: Workbench):
    # computing the whole sequence (no prefix cache) gives what the cached steps gave, to float32 rounding
    assert set(bench.replay_vs_run) == {"edit-one", "draw"}
    assert max(bench.replay_vs_run.values()) < 1e-4
    # the proxy's reference is the unquantized replay itself: the same computation again, exactly
    assert bench._replay_floor == {"edit-one": 0.0, "draw": 0.0}
    assert bench.proxy({}) == {"edit-one": 0.0, "draw": 0.0}


def test_the_proxy_is_taken_against_the_unquantized_replay(bench: Workbench):
    """The proxy's definition, computed here from the replayed calls: the quantized replay's relative L2
    distance from the unquantized replay of the same calls (not from the recorded outputs, from which the replay
    may differ by what the run computed otherwise)."""
    name = next(
        n for n, m in bench.component.named_modules() if isinstance(m, torch.nn.Linear) and ".attn." in n
    )
    expected = {}
    with torch.inference_mode():
        for fixture_id, replay in bench._replays.items():
            tokens = replay.reference.shape[1]
            plain = bench.component(**replay.kwargs)[0].float()[:, -tokens:]
            with layers_quantized(bench.component, {name: "fp8"}):
                quantized = bench.component(**replay.kwargs)[0].float()[:, -tokens:]
            expected[fixture_id] = float((quantized - plain).norm() / plain.norm())
    found = bench.proxy({name: "fp8"})
    assert found.keys() == expected.keys()
    assert all(found[f] == pytest.approx(expected[f], rel=1e-6) and 0 < found[f] < 0.05 for f in found)


def test_an_unquantized_run_reproduces_the_reference_images(bench: Workbench):
    psnr = bench.images({}, [1, 2])
    assert all(db == PSNR_CAP_DB for per_seed in psnr.values() for db in per_seed.values())


def test_each_unit_is_measured_under_each_scheme(bench: Workbench):
    linears = [
        n for n, m in bench.component.named_modules() if isinstance(m, torch.nn.Linear) and ".attn." in n
    ]
    units = [Unit(n, "layer", (n,), 32 * 32) for n in linears[:2]]
    units.append(Unit("(all)", "component", tuple(linears), 32 * 32 * len(linears)))
    found = measure_sensitivity(bench, units, SCHEMES, [1], lambda unit: unit.kind == "component")
    assert [e.layer for e in found.entries] == [u.name for u in units]
    for entry in found.entries:
        assert set(entry.proxy) == set(SCHEMES) and all(v > 0 for v in entry.proxy.values())
        # weight-only int8 disturbs less than fp8 weights and activations
        assert entry.proxy["w8a16"] < entry.proxy["fp8"]
    whole = found.entries[-1]
    assert set(whole.psnr_db) == set(SCHEMES) and all(db < PSNR_CAP_DB for db in whole.psnr_db.values())
    assert not found.entries[0].psnr_db  # layers: the proxy only
    assert set(found.proxy[("(all)", "fp8")]) == {"edit-one", "draw"}
