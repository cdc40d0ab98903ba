"""`ditq serve --variant NAME`: a source that ships only a variant's weights serves; without it, start-up fails."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from serve_testkit import FAST, client_for, free_port, make_app
from tiny_models import save_tiny_pipeline, to_variant_only

from ditq.cli import main
from ditq.commands import serve as serve_command
from ditq.pipeline.open import open_pipeline
from ditq.runtime.options import LoadOptions
from ditq.serve.startup import make_doctor


@pytest.fixture
def variant_only(tmp_path: Path) -> Path:
    save_tiny_pipeline(tmp_path / "model", dtype=torch.bfloat16)
    to_variant_only(tmp_path / "model", "bf16")
    return tmp_path / "model"


def test_serve_loads_the_variant_it_is_given(variant_only: Path) -> None:
    parser = argparse.ArgumentParser()
    serve_command.add_arguments(parser)
    assert parser.parse_args(["--variant", "bf16"]).variant == "bf16"
    app = make_app(
        load=lambda: open_pipeline(
            variant_only, LoadOptions(device="cpu", dtype="float32", skip_doctor=True, variant="bf16")
        ),
        doctor=make_doctor(),
    )
    with client_for(app) as client:
        assert client.get("/health").json()["status"] == "ready"
        response = client.post("/v1/images/generations", json={"prompt": "a kite", "seed": 0, **FAST})
        assert response.status_code == 200 and response.json()["size"] == "32x32"


def test_serve_without_the_variant_stops_naming_the_variants_there(
    variant_only: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", str(variant_only), "--port", str(free_port())]) == 4  # a start-up failure
    assert "variants here: bf16; choose one with --variant" in capsys.readouterr().err
