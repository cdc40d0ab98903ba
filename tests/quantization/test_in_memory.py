"""The in-memory quantizer: ``ditq.quantize_`` + ``ditq.save`` writes ``ditq quantize``'s artifact byte for byte,
and the pipeline quantized in memory computes what the saved artifact, loaded, computes."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import save_tiny_pipeline

import ditq
from ditq.demo import build_tiny_pipeline, default_model_dir, load_demo_pipeline, plan_path
from ditq.errors import InputError
from ditq.pipeline.open import load_pipeline
from ditq.quantization.in_memory import quantized_linear
from ditq.quantization.plan_file import read_plan
from ditq.runtime.adapter import GenerationRequest, PipelineAdapter
from ditq.runtime.modules import quantized_linears
from ditq.schemes import FP8


def _tree(root: Path) -> dict[str, bytes | str]:
    """Every entry of an artifact: a file's bytes, a link's target (the unquantized components are links)."""
    found: dict[str, bytes | str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in (*dirnames, *filenames):
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            if path.is_symlink():
                found[rel] = os.readlink(path)
            elif path.is_file():
                found[rel] = path.read_bytes()
    return found


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model quantized twice per way: by ``ditq quantize`` and by ``quantize_`` + ``save``, uniformly
    (w8a8, every auto component) and by its shipped plan."""
    root = tmp_path_factory.mktemp("in-memory")
    ditq.quantize(default_model_dir(), root / "cli", "w8a8")
    ditq.quantize(default_model_dir(), root / "cli-plan", plan=str(plan_path()))
    uniform = load_demo_pipeline()
    ditq.quantize_(uniform, "w8a8")
    ditq.save(uniform, root / "memory")
    planned = load_demo_pipeline()
    ditq.quantize_(planned, str(plan_path()))
    ditq.save(planned, root / "memory-plan")
    return root


@pytest.mark.parametrize(("cli", "memory"), [("cli", "memory"), ("cli-plan", "memory-plan")])
def test_save_writes_ditq_quantizes_artifact_byte_for_byte(demo: Path, cli: str, memory: str) -> None:
    expected, written = _tree(demo / cli), _tree(demo / memory)
    assert sorted(written) == sorted(expected)
    assert [name for name in expected if written[name] != expected[name]] == []
    assert ditq.verify(demo / memory).ok


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, Path]:
    """A tiny pipeline loaded from its directory, quantized in memory (fp8) and saved; and the saved artifact."""
    root = tmp_path_factory.mktemp("tiny")
    save_tiny_pipeline(root / "source")
    pipeline = load_demo_pipeline(root / "source")
    ditq.quantize_(pipeline, "fp8")
    ditq.save(pipeline, root / "fp8")
    return pipeline, root / "fp8"


def _run(pipeline: object) -> np.ndarray:
    request = GenerationRequest(prompt="a red circle", seed=0, num_inference_steps=2, width=32, height=32)
    return np.asarray(PipelineAdapter(pipeline)(request).images[0])


def test_quantized_in_memory_computes_what_the_saved_artifact_computes(tiny: tuple[object, Path]) -> None:
    pipeline, artifact = tiny
    loaded = load_pipeline(artifact, device="cpu")
    in_memory = quantized_linears(pipeline.transformer)  # type: ignore[attr-defined]
    from_disk = quantized_linears(loaded.transformer)
    assert sorted(in_memory) == sorted(from_disk)
    assert {n: m.kernel.name for n, m in in_memory.items()} == {  # type: ignore[union-attr]
        n: m.kernel.name  # type: ignore[union-attr]
        for n, m in from_disk.items()
    }
    image = _run(pipeline)
    assert np.array_equal(image, _run(loaded))
    assert not np.array_equal(image, _run(load_demo_pipeline(artifact.parent / "source")))  # it is quantized


def test_save_after_the_first_forward_still_reads_what_the_kernel_kept(tiny: tuple[object, Path]) -> None:
    """fp8 on the CPU keeps its stored tensors through the repack: saving again writes the same artifact."""
    pipeline, artifact = tiny
    _run(pipeline)
    again = artifact.parent / "fp8-again"
    ditq.save(pipeline, again)
    assert _tree(again) == _tree(artifact)


def test_a_module_quantized_alone_saves_as_its_named_component(tmp_path: Path) -> None:
    source = tmp_path / "source"
    save_tiny_pipeline(source, seed=1)
    pipeline = load_demo_pipeline(source)
    ditq.quantize_(pipeline.transformer, "w8a16", targets=[r"attn\.to_"])
    ditq.save(pipeline, tmp_path / "memory")
    ditq.quantize(source, tmp_path / "cli", "w8a16", components="transformer", targets=[r"attn\.to_"])
    assert _tree(tmp_path / "memory") == _tree(tmp_path / "cli")


def test_bad_arguments_are_one_line_naming_them(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"^scheme_or_plan: 'int4' is neither a scheme"):
        ditq.quantize_(torch.nn.Linear(64, 64), "int4")
    with pytest.raises(InputError, match=r"^targets: a plan names each layer"):
        ditq.quantize_(torch.nn.Linear(64, 64), read_plan(plan_path()), targets="x")
    with pytest.raises(InputError, match=r"^module_or_pipeline: a torch.nn.Module or a diffusers pipeline"):
        ditq.quantize_(object(), "w8a8")
    unsourced = build_tiny_pipeline(seed=2)
    with pytest.raises(
        InputError,
        match=r"^module_or_pipeline: the pipeline was not loaded from a directory \(no name_or_path\); it tells",
    ):
        ditq.quantize_(unsourced, "w8a8")
    with pytest.raises(InputError, match=r"^pipeline: no component was quantized in memory"):
        ditq.save(unsourced, tmp_path / "out")
    ditq.quantize_(unsourced.transformer, "w8a8")
    with pytest.raises(
        InputError,
        match=r"^pipeline: the pipeline was not loaded from a directory \(no name_or_path\); the artifact's",
    ):
        ditq.save(unsourced, tmp_path / "out")
    with pytest.raises(InputError, match=r": already quantized \(holds QuantizedLinear layers\)$"):
        ditq.quantize_(unsourced.transformer, "w8a8")
    broken = build_tiny_pipeline(seed=3).transformer
    with torch.no_grad():
        broken.transformer_blocks[0].attn.to_q.weight[0, 0] = float("nan")
    with pytest.raises(InputError, match=r": tensor transformer_blocks.0.attn.to_q.weight holds NaN or Inf$"):
        ditq.quantize_(broken, "w8a8")
    assert not quantized_linears(broken)  # nothing swapped
    assert not (tmp_path / "out").exists()


def test_save_refuses_layers_that_are_not_what_ditq_quantize_derives(tmp_path: Path) -> None:
    source = tmp_path / "source"
    save_tiny_pipeline(source, seed=4)
    pipeline = load_demo_pipeline(source)
    ditq.quantize_(pipeline.transformer, "w8a8")
    attn = pipeline.transformer.transformer_blocks[0].attn
    attn.to_q = quantized_linear(torch.nn.Linear(attn.to_q.in_features, attn.to_q.out_features), FP8)[0]
    with pytest.raises(
        InputError, match=r"^pipeline: transformer.transformer_blocks.0.attn.to_q: .* not w8a8's stored form$"
    ):
        ditq.save(pipeline, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source"]  # nothing written, no lock left
