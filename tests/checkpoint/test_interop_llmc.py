"""Checkpoints that llm-compressor's ``model_free_ptq`` wrote (W8A8, FP8_DYNAMIC, W8A16 in groups of 16; bfloat16
scales; committed under tests/data/llmc with the script that made them) load, verify and pass the doctor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import LLMC_DATA, LLMC_SCHEMES, llmc_pipeline_dir

import ditq
from ditq.cli import main
from ditq.doctor import run_doctor
from ditq.doctor.artifact import artifact_cases
from ditq.runtime.loader import load_component, stored_layer_schemes
from ditq.runtime.modules import quantized_linears

BLOCK_LINEARS = 14  # 2 blocks x (to_q, to_k, to_v, to_out.0, img_mlp.proj, img_mlp.gate_layer, img_mlp.out)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return llmc_pipeline_dir(tmp_path_factory.mktemp("llmc") / "source", "source")


@pytest.fixture(scope="module", params=sorted(LLMC_SCHEMES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    fixture = str(request.param)
    return fixture, llmc_pipeline_dir(tmp_path_factory.mktemp("llmc") / fixture, fixture)


def _forward(transformer: torch.nn.Module) -> torch.Tensor:
    """One seeded forward of the demo transformer: a 4x4 latent of 64 channels after 5 text tokens of 32."""
    generator = torch.Generator().manual_seed(0)
    text_len, h, w = 5, 4, 4
    with torch.no_grad():
        return transformer(
            hidden_states=torch.randn(1, h * w, 64, generator=generator),
            encoder_hidden_states=torch.randn(1, text_len, 32, generator=generator),
            timestep=torch.tensor([0.5]),
            img_shapes=[[(1, h, w)]],
            img_mask=torch.tensor([[False] * text_len + [True] * (h * w // 4)]),
            return_dict=False,
        )[0]


def test_the_fixtures_are_what_their_script_says() -> None:
    provenance = json.loads((LLMC_DATA / "PROVENANCE.json").read_text())
    assert provenance["versions"]["llmcompressor"].startswith("0.14")
    assert sorted(provenance["schemes"]) == sorted(LLMC_SCHEMES)
    size = sum(p.stat().st_size for p in LLMC_DATA.rglob("*") if p.is_file())
    assert size < 400_000, size


def test_loads_with_each_layers_scheme_from_its_config_group(
    checkpoint: tuple[str, Path], source: Path
) -> None:
    fixture, model_dir = checkpoint
    schemes = stored_layer_schemes(model_dir, "transformer")
    assert len(schemes) == BLOCK_LINEARS
    assert {s.name for s in schemes.values()} == {LLMC_SCHEMES[fixture]}
    assert {s.group_size for s in schemes.values()} == {16 if fixture == "w8a16" else None}
    transformer = load_component(model_dir, "transformer", dtype=torch.float32)
    assert len(quantized_linears(transformer)) == BLOCK_LINEARS
    reference = load_component(source, "transformer", dtype=torch.float32)
    got, expected = _forward(transformer), _forward(reference)
    error = float(torch.linalg.vector_norm(got - expected) / torch.linalg.vector_norm(expected))
    assert 0 < error < 0.05, error  # measured 0.0002 (w8a16), 0.0004 (w8a8), 0.002 (fp8)


def test_verify_runs_every_check_but_the_manifests(checkpoint: tuple[str, Path], source: Path) -> None:
    _, model_dir = checkpoint
    report = ditq.verify(model_dir, source=source)
    assert report.ok, report.table()
    status = {c.name: c.status for c in report.checks}
    assert status["manifest"] == "n/a" and status["files"] == "n/a"
    assert status["transformer: config"] == "pass"
    (config,) = [c for c in report.checks if c.name == "transformer: config"]
    assert config.detail.endswith("(no manifest to compare it with)")
    assert status["transformer: targets"] == status["transformer: decode"] == "pass"
    assert status["transformer: source"] == "pass"
    table = report.table()
    assert "N/A   manifest" in table and "PASS  manifest" not in table
    assert sum(t["decoders_agree"] for t in report.tensors) == BLOCK_LINEARS


def test_verify_of_a_foreign_checkpoint_still_fails_on_a_flipped_byte(
    checkpoint: tuple[str, Path], tmp_path: Path
) -> None:
    fixture, _ = checkpoint
    model_dir = llmc_pipeline_dir(tmp_path / "flipped", fixture)
    weights = model_dir / "transformer" / "diffusion_pytorch_model.safetensors"
    header = int.from_bytes(weights.read_bytes()[:8], "little")
    entry = json.loads(weights.read_bytes()[8 : 8 + header])["transformer_blocks.0.attn.to_q.weight_scale"]
    data = bytearray(weights.read_bytes())
    data[8 + header + entry["data_offsets"][0] + 1] ^= 0xFF  # the sign and exponent of the first bf16 scale
    weights.write_bytes(bytes(data))
    report = ditq.verify(model_dir)
    assert not report.ok
    assert "transformer_blocks.0.attn.to_q" in report.table()


def test_the_doctor_checks_the_checkpoints_own_layers(checkpoint: tuple[str, Path]) -> None:
    fixture, model_dir = checkpoint
    cases = artifact_cases(model_dir)
    assert list(cases) == [LLMC_SCHEMES[fixture]]
    assert all(
        c.stored["weight_scale"].dtype == torch.bfloat16 for c in cases[LLMC_SCHEMES[fixture]].values()
    )
    results = run_doctor("cpu", model_dir)
    ran = [r for r in results if r.verdict != "SKIP"]
    assert ran and all(r.verdict == "PASS" for r in ran), [(r.path, r.verdict, r.reason) for r in ran]


def test_verify_and_doctor_from_the_command_line(
    checkpoint: tuple[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    _, model_dir = checkpoint
    assert main(["verify", str(model_dir)]) == 0
    assert main(["doctor", "--artifact", str(model_dir), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "N/A" in out and "FAIL" not in out
