"""SVDQuant's low-rank branch (``--low-rank R``): the branch absorbs a weight's largest directions, so the quantized
residual plus the branch is closer to the weight than the weight quantized alone (round to nearest and GPTQ); an
artifact written with it records the rank, verifies against its source, and loads into the same outputs as the
pipeline quantized in memory, through ``load_pipeline`` and diffusers' ``from_pretrained``; a bad rank is one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import save_tiny_pipeline

import ditq
import ditq.diffusers  # registers the compressed-tensors backend with diffusers
from ditq.checkpoint.codecs import codec_for
from ditq.checkpoint.low_rank import LOW_RANK_DOWN, LOW_RANK_UP
from ditq.checkpoint.manifest import read_manifest
from ditq.cli import main
from ditq.demo import load_demo_pipeline
from ditq.errors import InputError
from ditq.numerics import dequantize_weight, quantize_weight, relative_l2
from ditq.quantization.calibrated import Calibration, calibrated_layers
from ditq.quantization.low_rank import split_low_rank
from ditq.runtime.modules import quantized_linears
from ditq.schemes import W4A16

N, K, RANK = 64, 256, 8
SCHEME = W4A16  # groups of 128 along K = 256


def _low_rank_plus_noise(seed: int = 0) -> torch.Tensor:
    """(N, K): a few large directions (what dominates a 4-bit weight's scales) over small noise."""
    g = torch.Generator().manual_seed(seed)
    directions = torch.randn(N, RANK, generator=g) @ torch.randn(RANK, K, generator=g)
    return directions / RANK**0.5 + 0.05 * torch.randn(N, K, generator=g)


def _decoded(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The layer's weight from its stored tensors: the branch plus the dequantized residual."""
    weight = dequantize_weight(*codec_for(SCHEME).read(tensors))
    if LOW_RANK_UP in tensors:
        weight += tensors[LOW_RANK_UP].float() @ tensors[LOW_RANK_DOWN].float()
    return weight


def test_the_branch_absorbs_the_largest_directions_before_round_to_nearest() -> None:
    weight = _low_rank_plus_noise()
    split = split_low_rank(weight, RANK)
    assert split.up.dtype == split.down.dtype == torch.bfloat16
    assert (tuple(split.up.shape), tuple(split.down.shape)) == ((N, RANK), (RANK, K))
    # the residual is taken against the rounded branch: together they are the weight, to float32 rounding
    torch.testing.assert_close(
        split.residual + split.up.float() @ split.down.float(), weight, rtol=0, atol=1e-6
    )
    alone = relative_l2(dequantize_weight(*quantize_weight(weight, SCHEME)), weight)
    q, scale = quantize_weight(split.residual, SCHEME)
    with_branch = relative_l2(dequantize_weight(q, scale) + split.up.float() @ split.down.float(), weight)
    assert with_branch < 0.5 * alone, (with_branch, alone)


def test_gptq_rounds_the_residual_with_the_layers_hessian() -> None:
    layer = torch.nn.Linear(K, N, bias=False)
    with torch.no_grad():
        layer.weight.copy_(_low_rank_plus_noise(1))
    inputs = torch.randn(1024, K, generator=torch.Generator().manual_seed(2)) * torch.linspace(0.2, 2.0, K)

    def run() -> None:
        with torch.no_grad():
            layer(inputs)

    model = torch.nn.Sequential(layer)
    held_out = torch.randn(256, K, generator=torch.Generator().manual_seed(3)) * torch.linspace(0.2, 2.0, K)
    errors = {}
    for rank in (0, RANK):
        stored = calibrated_layers(model, {"0": SCHEME}, Calibration(run=run), rank)["0"]
        assert (LOW_RANK_UP in stored.tensors) == bool(rank)
        decoded = _decoded(stored.tensors)
        assert stored.rel_l2 == pytest.approx(relative_l2(decoded, layer.weight.detach()), rel=1e-6)
        errors[rank] = relative_l2(held_out @ decoded.T, held_out @ layer.weight.detach().T)
    assert errors[RANK] < 0.5 * errors[0], errors


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    """A tiny source; the pipeline quantized in memory (w4a16, rank 4) and saved; the same by ``ditq quantize``."""
    root = tmp_path_factory.mktemp("low-rank")
    source = save_tiny_pipeline(root / "source")
    pipeline = load_demo_pipeline(source)
    ditq.quantize_(pipeline, "w4a16", low_rank=4)
    ditq.save(pipeline, root / "memory")
    assert main(["quantize", str(source), str(root / "cli"), "--scheme", "w4a16", "--low-rank", "4"]) == 0
    return root, pipeline


def _image(pipeline: object) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    out = pipeline(  # type: ignore[operator]
        "a red circle", num_inference_steps=2, height=32, width=32, generator=generator, output_type="pt"
    )
    return out.images


def test_the_artifact_records_the_rank_verifies_and_runs_as_in_memory(
    artifacts: tuple[Path, object],
) -> None:
    from diffusers import DiffusionPipeline

    root, pipeline = artifacts
    for written in ("memory", "cli"):
        manifest = read_manifest(root / written)
        assert manifest["options"]["low_rank"] == 4
        record = manifest["components"]["transformer"]["low_rank"]
        assert record["rank"] == 4 and record["tensors"] == [LOW_RANK_UP, LOW_RANK_DOWN]
        report = ditq.verify(root / written, root / "source")
        assert report.ok, report.table()
        assert {t.get("low_rank") for t in report.tensors} == {4}
    memory, cli = (sorted((root / w / "transformer").glob("*.safetensors")) for w in ("memory", "cli"))
    assert [p.read_bytes() for p in memory] == [p.read_bytes() for p in cli]  # one split, whichever way

    layers = quantized_linears(pipeline.transformer)  # type: ignore[attr-defined]
    assert {layer.low_rank for layer in layers.values()} == {4}
    expected = _image(pipeline)
    loaded = ditq.load_pipeline(root / "memory", device="cpu")
    assert {m.low_rank for m in quantized_linears(loaded.transformer).values()} == {4}
    assert torch.equal(_image(loaded), expected)
    assert torch.equal(_image(DiffusionPipeline.from_pretrained(root / "memory")), expected)


def test_a_bad_rank_is_one_line_and_writes_nothing(
    tmp_path: Path, artifacts: tuple[Path, object], capsys: pytest.CaptureFixture[str]
) -> None:
    source = artifacts[0] / "source"
    cases = {
        "0": "--low-rank must be a positive integer (a rank), got 0",
        "32": "--low-rank 32: transformer_blocks.0.attn.to_q is (32, 32); the rank must be below 32",
    }
    for rank, message in cases.items():
        capsys.readouterr()
        assert (
            main(["quantize", str(source), str(tmp_path / "out"), "--scheme", "w4a16", "--low-rank", rank])
            == 2
        )
        assert capsys.readouterr().err.strip().splitlines() == [f"ditq quantize: error: {message}"]
    assert main(["quantize", str(source), str(tmp_path / "out"), "--scheme", "w8a8", "--low-rank", "4"]) == 2
    assert "not with w8a8" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    with pytest.raises(InputError, match=r"^--low-rank must be a positive integer \(a rank\), got -1$"):
        ditq.quantize_(load_demo_pipeline(source).transformer, "w4a16", low_rank=-1)
