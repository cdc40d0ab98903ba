"""`ditq generate --lora NAME=PATH[:SCALE]`: the adapters load onto the pipeline generate opens as `ditq serve --lora`
loads them (the seeded adapter of ``lora_kit``, in peft's keys and in diffusers'), the image is the one ditq's Python
pipeline draws with the same adapters loaded by diffusers' own calls, the report names each adapter at its scale, and
bad input is one line naming the flag before the model loads."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

import ditq
from ditq.cli import main

pytest.importorskip("peft")

PROMPT, SEED, STEPS = "a red circle", 1, 3  # at 32x32


def _drawn(pipeline: Any) -> np.ndarray:
    generator = torch.Generator().manual_seed(SEED)
    image = pipeline(
        prompt=PROMPT, width=32, height=32, num_inference_steps=STEPS, generator=generator
    ).images[0]
    return np.asarray(image)


@pytest.fixture(scope="module")
def reference(demo_artifacts: dict[str, Path], lora_files: dict[str, Path]) -> tuple[np.ndarray, np.ndarray]:
    """(with the adapters, without): ditq's Python pipeline (the registry's first kernel paths, as --skip-doctor),
    the adapters loaded by diffusers' own calls, style at 1 and bold at 0.5."""
    pipeline = ditq.load_pipeline(demo_artifacts["fp8"], device="cpu")
    plain = _drawn(pipeline)
    pipeline.transformer.load_lora_adapter(str(lora_files["peft"]), adapter_name="style", prefix=None)
    with warnings.catch_warnings():  # peft's note that the model holds an adapter already
        warnings.simplefilter("ignore", UserWarning)
        pipeline.transformer.load_lora_adapter(
            str(lora_files["diffusers"]), weight_name="pytorch_lora_weights.safetensors", adapter_name="bold"
        )
    pipeline.transformer.set_adapters(["style", "bold"], [1.0, 0.5])
    return _drawn(pipeline), plain


# --cache beside --lora (none, a setting that never skips, one that skips all it may) -> the line generate prints
CACHES: list[tuple[list[str], str | None]] = [
    ([], None),
    (["--cache", "first-block:0"], "cache      first-block:0: 0 of 3 steps from the cache"),
    (["--cache", "first-block:1e9"], "cache      first-block:1e+09: 1 of 3 steps from the cache"),
]


@pytest.mark.parametrize(("cache", "says"), CACHES, ids=["no-cache", "first-block-0", "first-block-1e9"])
def test_generate_draws_what_the_python_pipeline_draws_with_the_same_adapters(
    demo_artifacts: dict[str, Path],
    lora_files: dict[str, Path],
    reference: tuple[np.ndarray, np.ndarray],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    cache: list[str],
    says: str | None,
) -> None:
    out = tmp_path / "out.png"
    argv = [
        "generate",
        str(demo_artifacts["fp8"]),
        "--prompt",
        PROMPT,
        "--seed",
        str(SEED),
        "--steps",
        str(STEPS),
    ]
    argv += [
        "--size",
        "32x32",
        "--device",
        "cpu",
        "--skip-doctor",
        "--on-collapse",
        "warn",
        "--out",
        str(out),
    ]
    lora = ["--lora", f"style={lora_files['peft']}", "--lora", f"bold={lora_files['diffusers']}:0.5"]
    assert main([*argv, *lora, *cache]) == 0
    printed = capsys.readouterr().out
    assert "lora       style x1 (8 layers, " in printed and ", bold x0.5 (8 layers, " in printed
    assert says is None or says in printed
    with Image.open(out) as image:
        generated = np.asarray(image)
    adapted, plain = reference
    assert not np.array_equal(generated, plain)  # the adapters change the image, under the step cache too
    # exactly the adapted image, unless the step cache skipped a step
    assert np.array_equal(generated, adapted) == (says is None or " 0 of " in says)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--lora", "style"], "--lora 'style': expected NAME=PATH[:SCALE]"),
        (["--lora", "style=missing.safetensors"], "--lora style=missing.safetensors: no such file or folder"),
        (["--lora", "style={file}:12"], "scale 12 is not a finite number in [-10, 10]"),
        (["--lora", "style={file}", "--lora", "style={file}:0.5"], "--lora: the name 'style' is given twice"),
        (["--lora", "style={file}", "--offload", "model"], "--lora: not run beside --offload model yet"),
        (["--lora", "style={file}", "--compile"], "--lora: not run beside --compile yet"),
    ],
)
def test_bad_lora_flags_are_one_line_usage_errors_before_the_model_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    (tmp_path / "model_index.json").write_text("{}")  # never read: refused before the model opens
    (tmp_path / "style.safetensors").write_bytes(b"")
    given = [flag.replace("{file}", str(tmp_path / "style.safetensors")) for flag in flags]
    assert main(["generate", str(tmp_path), "--prompt", PROMPT, "--device", "cpu", *given]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
