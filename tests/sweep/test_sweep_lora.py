"""`ditq sweep --lora PATH[:SCALE]`: every server the sweep starts, the baseline's and each candidate's, loads the
adapter (so each candidate with it is judged against the source with it); what would draw an image without it is
refused before anything runs; another adapter makes an earlier sweep's runs stale."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ditq.cli import main
from ditq.demo import default_model_dir, references_dir
from ditq.demo.settings import demo_fixtures
from ditq.errors import InputError
from ditq.runfiles import SWEEP_FILE, SweepFile, write_model
from ditq.runtime.lora_adapters import LoraSpec
from ditq.runtime.options import LoadOptions
from ditq.sweep import SweepOptions, check_same_model, default_serve_argv, model_fingerprint
from ditq.sweep.run import lora_fingerprint


@pytest.fixture
def adapter(tmp_path: Path) -> Path:
    path = tmp_path / "style.safetensors"
    save_file({"transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(4, 8)}, path)
    return path


@pytest.fixture
def options(tmp_path: Path, adapter: Path) -> SweepOptions:
    return SweepOptions(
        model=default_model_dir(),
        schemes=("fp8",),
        fixtures=demo_fixtures(tmp_path),
        refs=references_dir(),
        out=tmp_path / "sweep",
        load=LoadOptions(device="cpu"),
        lora=LoraSpec.of_path(f"{adapter}:0.5", "adapter"),
    )


def test_the_baseline_and_every_candidate_serve_with_the_adapter_at_its_scale(options: SweepOptions) -> None:
    for model in (options.model, options.out / "fp8" / "artifact"):
        argv = default_serve_argv(model, 8000, options, "none")
        given = LoraSpec.parse(argv[argv.index("--lora") + 1])  # as ditq serve reads it
        assert given == LoraSpec("adapter", options.lora.path, 0.5)  # type: ignore[union-attr]
    plain = dataclasses.replace(options, lora=None)
    assert "--lora" not in default_serve_argv(plain.model, 8000, plain, "none")


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"offload": ("none", "model")}, "--offload none,model"),
        ({"parity_in_process": True}, "--parity-in-process"),
        ({"endpoint_for": {"fp8": "http://127.0.0.1:9"}}, "--endpoint-for"),
        ({"load": LoadOptions(device="cpu", compile="inductor")}, "--compile"),
    ],
)
def test_what_would_draw_without_the_adapter_is_refused_in_one_line(
    options: SweepOptions, change: dict[str, object], named: str
) -> None:
    with pytest.raises(InputError, match=f"--lora: not swept beside {named} yet; drop one or the other"):
        dataclasses.replace(options, **change)  # type: ignore[arg-type]


def test_another_adapter_makes_an_earlier_sweep_stale(options: SweepOptions, adapter: Path) -> None:
    before = model_fingerprint(options.model) | lora_fingerprint(options)
    earlier = SweepFile(
        command="ditq sweep (test)", model=str(options.model), model_fingerprint=before, schemes=["fp8"],
        fixtures="f", refs="r", seeds=None, steps=None, max_memory=None, offload=["none"], note=None, device="cpu",
        dtype=None, endpoint_for={}, parity_db=None, parity_pair=None, lora=f"{adapter}:0.5", pid=1,
    )  # fmt: skip
    options.out.mkdir()
    write_model(options.out / SWEEP_FILE, earlier)
    check_same_model(options.out, before)  # the same adapter: it resumes
    save_file({"transformer_blocks.0.attn.to_q.lora_A.weight": torch.ones(4, 8)}, adapter)
    os.utime(adapter, ns=(1, 1))
    with pytest.raises(
        InputError, match=r"other model files \(--lora .*style.safetensors \(scale 0.5\) changed"
    ):
        check_same_model(options.out, model_fingerprint(options.model) | lora_fingerprint(options))


def test_a_missing_adapter_is_a_usage_error_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["sweep", str(default_model_dir()), "--fixtures", str(demo_fixtures(tmp_path)), "--refs"]
    argv += [str(references_dir()), "--out", str(tmp_path / "out"), "--device", "cpu"]
    assert main([*argv, "--lora", str(tmp_path / "none.safetensors:0.5")]) == 2
    err = capsys.readouterr().err
    assert "none.safetensors: no such file or folder" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
