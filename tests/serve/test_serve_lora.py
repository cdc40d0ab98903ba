"""`ditq serve --lora`: LoRA adapters loaded at start onto the demo's fp8 artifact, picked per request by the `lora`
field through the official `openai` client on a live loopback server. A seeded adapter is made with peft (``lora_kit``)
and saved in peft's keys (a file) and in diffusers' (a folder); each request's image is the one ditq's Python pipeline
draws with the same adapters through diffusers' own calls, whatever the requests around it chose; /health and the
cost model count the adapters' bytes; bad input is one line naming the flag or field."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from lora_kit import TARGETS, drawn_with, load_both_adapters
from PIL import Image
from safetensors.torch import load_file, save_file
from serve_testkit import LiveServer, png_bytes

import ditq
from ditq.cli import main
from ditq.errors import InputError
from ditq.runfiles import LoraFacts, ServerHealth
from ditq.runtime.lora_adapters import LoraSpec, load_lora_adapters
from ditq.runtime.options import LoadOptions
from ditq.serve import ServeConfig
from ditq.serve.server import serving_app

peft = pytest.importorskip("peft")

ASK: dict[str, Any] = {"seed": 1, "num_inference_steps": 3}  # with size 32x32 and prompt PROMPT
PROMPT = "a red circle"


@pytest.fixture(scope="module")
def reference(demo_artifacts: dict[str, Path], lora_files: dict[str, Path]) -> Any:
    """ditq's Python pipeline with the same two adapters, loaded by diffusers' own calls."""
    pipeline = ditq.load_pipeline(demo_artifacts["fp8"], device="cpu")
    load_both_adapters(pipeline, lora_files)
    return pipeline


def drawn(pipeline: Any, adapters: dict[str, float]) -> np.ndarray:
    return drawn_with(pipeline, adapters, PROMPT, ASK["seed"], ASK["num_inference_steps"])


@pytest.fixture(scope="module")
def server(demo_artifacts: dict[str, Path], lora_files: dict[str, Path]) -> Iterator[LiveServer]:
    """``serving_app`` as ``ditq serve ARTIFACT --lora style=FILE --lora bold=FOLDER:0.5 --skip-doctor`` builds it
    (the registry's first kernel paths, as ``ditq.load_pipeline`` without a chooser)."""
    lora = (LoraSpec("style", lora_files["peft"]), LoraSpec("bold", lora_files["diffusers"], 0.5))
    # one reference and 32x32 at most: four shapes to calibrate
    config = ServeConfig(served_model_name="demo", on_collapse="warn", max_pixels=32 * 32, max_references=1)
    app, _ = serving_app(
        demo_artifacts["fp8"], config, LoadOptions(device="cpu", skip_doctor=True), lora=lora
    )
    with LiveServer(app) as live:
        assert app.state.serve.wait_loaded(120) and app.state.serve.phase == "ready", app.state.serve.failure
        yield live


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def served(client: openai.OpenAI, lora: Any = None) -> np.ndarray:
    extra = {**ASK, **({} if lora is None else {"lora": lora})}
    result = client.images.generate(model="demo", prompt=PROMPT, size="32x32", extra_body=extra)
    assert result.data is not None and result.data[0].b64_json is not None
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json))).convert("RGB"))


# (the request's lora field, or None to leave it out) -> the adapters the Python pipeline draws with
CHOICES: list[tuple[Any, dict[str, float]]] = [
    ({"name": "style"}, {"style": 1.0}),
    ([], {}),
    (None, {"style": 1.0, "bold": 0.5}),
    ([{"name": "bold", "scale": 2.0}], {"bold": 2.0}),
]


def test_each_request_draws_the_image_of_its_own_adapters_whatever_came_before_or_beside_it(
    client: openai.OpenAI, reference: Any
) -> None:
    expected = [drawn(reference, adapters) for _, adapters in CHOICES]
    assert not np.array_equal(expected[0], expected[1])  # the adapter changes the image
    assert not np.array_equal(expected[0], expected[2])  # and the second one, at its scale, changes it again
    # one after the other, then all at once: the worker runs them one at a time, each with its own choice
    assert all(
        np.array_equal(served(client, lora), want) for (lora, _), want in zip(CHOICES, expected, strict=True)
    )
    with ThreadPoolExecutor(len(CHOICES)) as pool:
        answers = list(pool.map(lambda choice: served(client, choice[0]), CHOICES * 2))
    assert all(np.array_equal(got, want) for got, want in zip(answers, expected * 2, strict=True))


# a request's lora field that picks no loaded adapter -> the start of its one-line 400
REFUSED: list[tuple[Any, str]] = [
    ({"name": "sketch"}, "lora: unknown adapter 'sketch' (loaded: style, bold)"),
    ([{"name": "style"}, {"name": "style", "scale": 0.5}], "lora: adapter 'style' given twice"),
    ({"name": "style", "scale": 11}, "lora: adapter 'style': scale 11 is not a finite number in [-10, 10]"),
    ({"name": "style", "path": "/etc/passwd"}, "lora.0.path: unknown field"),  # a request never names a file
]


def test_a_request_naming_no_loaded_adapter_is_a_400_and_health_counts_the_adapters_bytes(
    client: openai.OpenAI, server: LiveServer, lora_files: dict[str, Path]
) -> None:
    for lora, message in REFUSED:
        with pytest.raises(openai.BadRequestError) as caught:
            client.images.generate(
                model="demo", prompt=PROMPT, size="32x32", extra_body={**ASK, "lora": lora}
            )
        error = caught.value.body
        assert isinstance(error, dict) and error["message"].startswith(message), error
        assert "\n" not in error["message"] and error["param"].startswith("lora")

    # an edit's form carries the field as JSON text
    edit = {"prompt": PROMPT, "size": "32x32", "num_inference_steps": "2"}
    reference = {"image": ("a.png", png_bytes(), "image/png")}
    url = f"{server.base_url}/v1/images/edits"
    for lora, status, message in [
        ('{"name": "style", "scale": 0.5}', 200, None),
        ('[{"name": "sketch"}]', 400, "lora: unknown adapter 'sketch'"),
        ("{name: style}", 400, "lora: expected JSON text"),
    ]:
        answer = httpx.post(url, data={**edit, "lora": lora}, files=reference, timeout=120)
        assert answer.status_code == status and (
            message is None or message in answer.json()["error"]["message"]
        )

    stored = sum(t.numel() for t in load_file(lora_files["peft"]).values())  # A and B of 8 projections
    answer = httpx.get(f"{server.base_url}/health")
    health = answer.json()
    adapters = {adapter["name"]: adapter for adapter in health["lora"]["adapters"]}
    # peft keeps an adapter in its layer's activation dtype (bfloat16 beside the fp8 GEMM here): 2 bytes a value
    assert adapters["style"] == {"name": "style", "scale": 1.0, "layers": 8, "parameter_bytes": 2 * stored}
    assert adapters["bold"]["scale"] == 0.5 and adapters["bold"]["parameter_bytes"] == 2 * stored
    assert health["lora"]["parameter_bytes"] == 4 * stored == health["cost_model"]["adapter_bytes"]
    assert ServerHealth.model_validate(health).lora == LoraFacts.model_validate(
        health["lora"]
    )  # as the report reads it
    assert str(lora_files["peft"].parent) not in answer.text  # /health names no local path


def test_an_adapter_that_fits_no_layer_only_some_or_asks_for_dora_is_refused_naming_it(
    demo_artifacts: dict[str, Path], lora_files: dict[str, Path], tmp_path: Path
) -> None:
    state = load_file(lora_files["peft"])
    save_file({f"x{k}": v for k, v in state.items()}, tmp_path / "other.safetensors")
    save_file(
        {(f"x{k}" if ".0.attn.to_q" in k else k): v for k, v in state.items()}, tmp_path / "part.safetensors"
    )
    pipeline = ditq.load_pipeline(demo_artifacts["fp8"], device="cpu")
    with pytest.raises(
        InputError, match=r"--lora other=.*other.safetensors: it does not load onto the served"
    ):
        load_lora_adapters(pipeline, [LoraSpec("other", tmp_path / "other.safetensors")])
    with pytest.raises(
        InputError, match=r"--lora part=.*part.safetensors: 2 of its 16 LoRA weights match no layer"
    ):
        load_lora_adapters(pipeline, [LoraSpec("part", tmp_path / "part.safetensors")])
    dora = tmp_path / "dora"  # peft's layout, its config asking for DoRA, which a quantized Linear refuses
    dora.mkdir()
    save_file({f"base_model.model.{k}": v for k, v in state.items()}, dora / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 4, "target_modules": TARGETS, "use_dora": True}
    (dora / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(
        InputError, match=r"--lora dora=.*dora: LoRA on a quantized Linear: DoRA is not supported"
    ):
        load_lora_adapters(pipeline, [LoraSpec("dora", dora)])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--lora", "style"], "--lora 'style': expected NAME=PATH[:SCALE]"),
        (["--lora", "a.b=x.safetensors"], "the name must be 1 to 64 letters, digits, '_' or '-'"),
        (
            ["--lora", "half=x.safetensors"],
            "--lora 'half=x.safetensors': the name 'half' is one of torch's Module",
        ),
        (["--lora", "style=missing.safetensors"], "--lora style=missing.safetensors: no such file or folder"),
        (["--lora", "style={file}:nan"], "scale nan is not a finite number in [-10, 10]"),
        (["--lora", "style={file}:12"], "scale 12 is not a finite number in [-10, 10]"),
        (["--lora", "style={file}", "--lora", "style={file}:0.5"], "--lora: the name 'style' is given twice"),
        (["--lora", "style={file}", "--offload", "model"], "--lora: not served beside --offload model yet"),
    ],
)
def test_bad_lora_flags_are_one_line_usage_errors_before_the_model_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    (tmp_path / "model_index.json").write_text("{}")
    (tmp_path / "style.safetensors").write_bytes(b"")
    given = [flag.replace("{file}", str(tmp_path / "style.safetensors")) for flag in flags]
    assert main(["serve", str(tmp_path), *given]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_a_peft_folder_loads_with_the_alpha_its_config_records(
    demo_artifacts: dict[str, Path], lora_files: dict[str, Path], tmp_path: Path
) -> None:
    """peft's save_pretrained layout: keys under ``base_model.model.``, alpha in ``adapter_config.json`` (here twice
    the rank, so the update is scaled by 2 before the --lora scale)."""
    state = load_file(lora_files["peft"])
    save_file({f"base_model.model.{k}": v for k, v in state.items()}, tmp_path / "adapter_model.safetensors")
    (tmp_path / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": TARGETS})
    )
    pipeline = ditq.load_pipeline(demo_artifacts["fp8"], device="cpu")
    adapters = load_lora_adapters(pipeline, [LoraSpec.parse(f"ink={tmp_path}:0.75")])
    assert adapters.to_json()["adapters"] == [
        {"name": "ink", "scale": 0.75, "layers": 8, "parameter_bytes": 4096}
    ]
    assert pipeline.transformer.get_submodule("transformer_blocks.1.attn.to_v").scaling == {"ink": 2 * 0.75}
