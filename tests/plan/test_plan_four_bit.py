"""4-bit candidates in a plan, rounded as the artifact rounds them: ``ditq plan --calibrate gptq --low-rank R``
records its rounding, ``ditq quantize --plan`` applies it (GPTQ from the same requests, the branch beside the 4-bit
layers only) or refuses flags that say otherwise; the size budget counts what each layer stores."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ditq
from ditq.calibration import CalibrationOptions, calibration_for
from ditq.checkpoint.codecs import codec_for
from ditq.checkpoint.low_rank import LOW_RANK_DOWN, LOW_RANK_UP
from ditq.checkpoint.stored import stored_bytes
from ditq.cli import main
from ditq.demo import load_demo_pipeline
from ditq.errors import InputError
from ditq.plan import KEEP, PlanRounding, read_plan, write_plan
from ditq.plan.planner import parse_budget
from ditq.quantization.gptq import hessian_hooks
from ditq.runtime.adapter import PipelineAdapter
from ditq.runtime.modules import quantized_linears
from ditq.schemes import W4A16, W8A8, get_scheme

RANK = 4


def _plan_args(workspace: Path, out: Path, *extra: str) -> list[str]:
    return [
        "plan", str(workspace / "model"), "--fixtures", str(workspace / "fixtures.json"),
        "--refs", str(workspace / "refs"), "--out", str(out), "--target-db", "40", "--seeds", "1",
        "--steps", "2", "--max-rounds", "1", "--image-blocks", "0", "--proxy-seeds", "1", *extra,
    ]  # fmt: skip


def _calibration_args(workspace: Path) -> list[str]:
    return ["--fixtures", str(workspace / "fixtures.json"), "--refs", str(workspace / "refs")]


@pytest.fixture(scope="module")
def gptq_plan(tiny_workspace: Path) -> Path:
    """A plan measured with GPTQ (requests at seed 0, 2 steps) and a rank-4 branch, then half its layers moved to
    w8a8: a mix of 4- and 8-bit layers under one rounding."""
    out = tiny_workspace / "PLAN-gptq.json"
    rounding = ["--schemes", "w4a16,w8a8", "--calibrate", "gptq", "--low-rank", str(RANK)]
    rounding += ["--calibration-seeds", "0", "--calibration-steps", "2"]
    assert main(_plan_args(tiny_workspace, out, *rounding)) in (0, 1) and out.is_file()
    plan = read_plan(out)
    names = sorted(plan.layers)
    mixed = {name: "w8a8" if i % 2 else "w4a16" for i, name in enumerate(names)}
    write_plan(out, plan.model_copy(update={"layers": mixed}))
    return out


def test_the_plan_records_its_rounding(gptq_plan: Path) -> None:
    rounding = read_plan(gptq_plan).rounding
    assert rounding.method == "gptq" and rounding.low_rank == RANK
    assert rounding.calibration is not None
    assert rounding.calibration.fixtures == ["draw", "edit-one"]
    assert (rounding.calibration.seeds, rounding.calibration.steps, rounding.calibration.requests) == (
        [0],
        2,
        2,
    )


def _layers(artifact: Path) -> dict[str, torch.Tensor]:
    return load_file(str(artifact / "transformer" / "diffusion_pytorch_model.safetensors"))


def _decoded(
    stored: dict[str, torch.Tensor], prefix: str, in_features: int, scheme_name: str
) -> torch.Tensor:
    """The layer's weight as the artifact holds it: the dequantized residual plus the branch where there is one."""
    scheme = get_scheme(scheme_name).fitted(in_features)
    local = {n: stored[f"{prefix}.{n}"] for n in codec_for(scheme).names}
    weight = codec_for(scheme).decode(local)
    if f"{prefix}.{LOW_RANK_UP}" in stored:
        weight += stored[f"{prefix}.{LOW_RANK_UP}"].float() @ stored[f"{prefix}.{LOW_RANK_DOWN}"].float()
    return weight


def test_quantize_applies_the_plans_gptq_and_branch(
    gptq_plan: Path, tiny_workspace: Path, tmp_path: Path
) -> None:
    model = tiny_workspace / "model"
    gptq, rtn = tmp_path / "gptq", tmp_path / "rtn"
    assert (
        main(
            ["quantize", str(model), str(gptq), "--plan", str(gptq_plan), *_calibration_args(tiny_workspace)]
        )
        == 0
    )
    assert main(["verify", str(gptq), "--source", str(model)]) == 0
    plan = read_plan(gptq_plan)
    rtn_plan = tmp_path / "PLAN-rtn.json"  # the same layers, rounded to nearest
    write_plan(rtn_plan, plan.model_copy(update={"rounding": PlanRounding(low_rank=RANK)}))
    assert main(["quantize", str(model), str(rtn), "--plan", str(rtn_plan)]) == 0

    # each layer's input Hessian over the plan's calibration requests (seed 0, 2 steps)
    pipeline = load_demo_pipeline(model)
    transformer = pipeline.transformer
    requests = CalibrationOptions(
        tiny_workspace / "fixtures.json", tiny_workspace / "refs", seeds=(0,), steps=2
    )
    with hessian_hooks(transformer, plan.layers) as found:
        calibration_for(PipelineAdapter(pipeline), requests).run()
    stored = {"gptq": _layers(gptq), "rtn": _layers(rtn)}
    for name, choice in plan.layers.items():
        source = transformer.get_submodule(name).weight.detach().float()
        in_features = source.shape[1]
        weights = {k: _decoded(v, name, in_features, choice) for k, v in stored.items()}
        assert not torch.equal(weights["gptq"], weights["rtn"]), name
        # the output error on the calibration inputs, tr(E H E^T) with E the weight's error: GPTQ's is lower
        errors = {
            k: float(torch.trace((w - source) @ found[name].hessian @ (w - source).T))
            for k, w in weights.items()
        }
        assert errors["gptq"] < errors["rtn"], (name, errors)
        branch = f"{name}.{LOW_RANK_UP}" in stored["gptq"]
        assert branch == (choice == "w4a16"), name  # the branch beside 4-bit layers only
    loaded = quantized_linears(ditq.load_pipeline(gptq, device="cpu").transformer)
    assert {name: layer.low_rank for name, layer in loaded.items()} == {
        name: RANK if choice == "w4a16" else 0 for name, choice in plan.layers.items()
    }


def test_a_layers_bytes_are_its_stored_tensors(gptq_plan: Path, tiny_workspace: Path, tmp_path: Path) -> None:
    artifact = tmp_path / "artifact"
    assert main(["quantize", str(tiny_workspace / "model"), str(artifact), "--plan", str(gptq_plan),
                 *_calibration_args(tiny_workspace)]) == 0  # fmt: skip
    stored, source = _layers(artifact), _layers(tiny_workspace / "model")
    for name, choice in read_plan(gptq_plan).layers.items():
        tensors = [t for key, t in stored.items() if key.startswith(f"{name}.") and not key.endswith(".bias")]
        out_features, in_features = source[f"{name}.weight"].shape
        scheme = get_scheme(choice).fitted(in_features)
        assert stored_bytes(scheme, out_features, in_features, RANK) == sum(t.nbytes for t in tensors), name
    # written out: K*N/2 packed, a float32 scale per group of 128 (per row where 128 does not divide K), the shape,
    # the branch's R*(N+K) bfloat16; 8 bits: K*N and a scale per row, no branch
    assert stored_bytes(W4A16, 64, 256, 16) == 64 * 256 // 2 + 64 * 2 * 4 + 16 + 16 * (64 + 256) * 2
    assert stored_bytes(W4A16.fitted(96), 64, 96) == 64 * 96 // 2 + 64 * 4 + 16
    assert stored_bytes(W8A8, 64, 256, 16) == 64 * 256 + 64 * 4


def test_the_size_budget_counts_stored_bytes() -> None:
    budget = parse_budget("1MiB", {"a": (64, 256)}, ["w4a16", "w8a8"], 2, 1000, 16)
    assert budget.cost["a"] == {
        "w4a16": stored_bytes(W4A16, 64, 256, 16),
        "w8a8": stored_bytes(W8A8, 64, 256),
        KEEP: 64 * 256 * 2,
    }
    assert budget.limit == 2**20 - 1000
    with pytest.raises(
        InputError, match=r"^--budget 10KB: under the component's size with every planned Linear"
    ):
        parse_budget("10KB", {"a": (64, 256)}, ["w4a16", "w8a8"], 2, 1000, 16)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--schemes", "fp8,w8a8", "--low-rank", "4"], "--low-rank goes with the 4-bit schemes (w4a16, w4a8), as "
         "SVDQuant uses it; the candidates fp8, w8a8 hold none"),
        (["--schemes", "fp8", "--calibrate", "gptq"], "--calibrate gptq rounds int weights (w4a16, w4a8, w8a16, "
         "w8a8); the candidates fp8 hold none"),
        (["--schemes", "w4a16", "--low-rank", "0"], "--low-rank must be a positive integer (a rank), got 0"),
    ],
)  # fmt: skip
def test_plan_refuses_rounding_flags_in_one_line(
    extra: list[str], message: str, tiny_workspace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tiny_workspace / "never.json"
    assert main(_plan_args(tiny_workspace, out, *extra)) == 2
    assert capsys.readouterr().err.strip() == f"ditq plan: error: {message}"
    assert not out.exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--calibrate", "rtn"], "--calibrate rtn: {plan} was measured with rounding.method gptq; leave the flag "
         "out to quantize it as planned, or plan again with it"),
        (["--low-rank", "8"], "--low-rank 8: {plan} was measured with rounding.low_rank 4; leave the flag out to "
         "quantize it as planned, or plan again with it"),
        (["--calibration-steps", "3"], "--calibration-steps: {plan} was measured with rounding.calibration.steps 2; "
         "leave the flag out to quantize it as planned"),
        (["--scheme", "w4a16"], "--plan and --scheme are mutually exclusive: the plan names each layer's scheme"),
    ],
)  # fmt: skip
def test_quantize_refuses_flags_that_contradict_the_plan(
    extra: list[str],
    message: str,
    gptq_plan: Path,
    tiny_workspace: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = [
        "quantize",
        str(tiny_workspace / "model"),
        str(tmp_path / "out"),
        "--plan",
        str(gptq_plan),
        *extra,
    ]
    assert main([*argv, *_calibration_args(tiny_workspace)]) == 2
    assert capsys.readouterr().err.strip() == f"ditq quantize: error: {message.format(plan=gptq_plan)}"
    assert not (tmp_path / "out").exists()


def test_a_plan_whose_low_rank_has_no_four_bit_scheme_is_refused(gptq_plan: Path, tmp_path: Path) -> None:
    text = gptq_plan.read_text().replace('"w4a16"', '"w8a16"')
    (tmp_path / "PLAN.json").write_text(text)
    with pytest.raises(
        InputError, match=r"PLAN.json: rounding.low_rank: goes with the 4-bit schemes; schemes are "
    ):
        read_plan(tmp_path / "PLAN.json")
