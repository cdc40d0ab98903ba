"""``--variant NAME``: a source whose weights exist only as a variant loads, generates and serves as diffusers'
``from_pretrained(variant=...)`` reads it; an artifact quantized from it reads the variant its manifest records."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import save_tiny_pipeline, to_variant_only

import ditq
from ditq.cli import main
from ditq.errors import InputError
from ditq.pipeline.generate import generate
from ditq.pipeline.open import load_pipeline
from ditq.runtime.adapter import GenerationRequest
from ditq.runtime.options import LoadOptions

VARIANT = "bf16"
REQUEST = dict(prompt="a red square", seed=3, num_inference_steps=2, width=32, height=32)


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the tiny pipeline saved in bfloat16 with default files, the same files renamed to the bf16 variant only)."""
    root = tmp_path_factory.mktemp("variant")
    save_tiny_pipeline(root / "default", dtype=torch.bfloat16)
    shutil.copytree(root / "default", root / "variant-only")
    assert to_variant_only(root / "variant-only", VARIANT) == ["text_encoder", "transformer"]
    return root / "default", root / "variant-only"


def _pixels(model_dir: Path, variant: str | None = None) -> np.ndarray:
    report = generate(
        model_dir, GenerationRequest(**REQUEST), LoadOptions(device="cpu", dtype="float32", variant=variant)
    )
    return np.asarray(report.result.images[0])


def test_a_variant_only_source_is_refused_without_variant_in_one_line(
    sources: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    _, variant_only = sources
    with pytest.raises(
        InputError, match=r"no \.safetensors weights \(variants here: bf16; choose one with --variant"
    ):
        load_pipeline(variant_only, dtype=torch.float32)
    with pytest.raises(
        InputError, match=r"no fp16 variant and no default \.safetensors weights \(variants here: bf16\)"
    ):
        load_pipeline(variant_only, dtype=torch.float32, variant="fp16")
    code = main(["generate", str(variant_only), "--prompt", "x", "--out", str(variant_only / "x.png")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "variants here: bf16" in err[0]
    assert not (variant_only / "x.png").exists()


def test_generate_with_variant_draws_what_the_default_files_draw(
    sources: tuple[Path, Path], tmp_path: Path
) -> None:
    default, variant_only = sources
    expected = _pixels(default)
    np.testing.assert_array_equal(_pixels(variant_only, VARIANT), expected)
    with pytest.raises(InputError, match=r"default: no component has bf16 variant weights"):
        _pixels(default, VARIANT)  # diffusers refuses a variant that no component has, too
    out = tmp_path / "cli.png"
    argv = ["generate", str(variant_only), "--variant", VARIANT, "--prompt", REQUEST["prompt"], "--seed", "3"]
    argv += ["--on-collapse", "warn"]  # the untrained pipeline draws a mostly transparent image
    assert main([*argv, "--steps", "2", "--size", "32x32", "--dtype", "float32", "--out", str(out)]) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from PIL import Image

        np.testing.assert_array_equal(np.asarray(Image.open(out)), expected)


def test_load_pipeline_variant_from_python(sources: tuple[Path, Path]) -> None:
    default, variant_only = sources
    loaded = ditq.load_pipeline(variant_only, dtype=torch.float32, variant=VARIANT)
    reference = ditq.load_pipeline(default, dtype=torch.float32)
    for name in ("transformer", "text_encoder"):
        got, want = loaded.components[name].state_dict(), reference.components[name].state_dict()
        assert sorted(got) == sorted(want)
        assert all(torch.equal(got[k], want[k]) for k in want), name


def test_an_artifact_of_a_variant_only_source_reads_the_variant_it_records(
    sources: tuple[Path, Path], tmp_path: Path
) -> None:
    default, variant_only = sources
    artifact = tmp_path / "w8a8"
    ditq.quantize(variant_only, artifact, "w8a8", variant=VARIANT)  # the text encoder is linked, variant-only
    assert ditq.verify(artifact, source=variant_only).ok
    from_default = tmp_path / "w8a8-default"
    ditq.quantize(default, from_default, "w8a8")
    np.testing.assert_array_equal(_pixels(artifact), _pixels(from_default))
    np.testing.assert_array_equal(_pixels(artifact, VARIANT), _pixels(from_default))
