"""Whole pipelines: load_pipeline with each offload mode, `ditq generate`, and the host-memory bound while loading."""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import ditq
from ditq.cli import main
from ditq.pipeline.open import load_pipeline
from ditq.runtime.adapter import GenerationRequest, PipelineAdapter
from ditq.runtime.modules import quantized_linears
from runtime.artifacts import write_large_qwen_artifact
from runtime.host_memory import measure

# Peak resident memory added while loading a pipeline under model offload, over the artifact's bytes.
HOST_LOAD_BOUND = 1.2


def _pixels(pipeline: object, seed: int = 0) -> np.ndarray:
    request = GenerationRequest(prompt="a red circle", seed=seed, num_inference_steps=2, width=32, height=32)
    return np.asarray(PipelineAdapter(pipeline)(request).images[0], dtype=np.int16)


def test_offload_modes_give_the_same_image(demo_artifacts: dict[str, Path]) -> None:
    images = {}
    for mode in ("none", "model", "block"):
        pipeline = load_pipeline(demo_artifacts["w8a8"], device="cpu", offload=mode)
        layers = quantized_linears(pipeline.transformer)
        assert layers and all(layer.prepared for layer in layers.values())  # repacked before any hook
        images[mode] = _pixels(pipeline)
    assert np.array_equal(images["none"], images["model"])
    assert np.array_equal(images["none"], images["block"])


def test_auto_offload_keeps_what_runs_most_and_streams_the_rest(demo_artifacts: dict[str, Path]) -> None:
    """--offload auto under a budget that holds the transformer only: the text encoder (run once a request) streams
    its blocks (on the CPU the hooks move nothing), the image is the resident pipeline's, and each demotion takes
    the next step until nothing is left to move. (Not bit for bit: with hooks on its layers, torch's
    TransformerEncoderLayer leaves its fused fast path for the plain one, which rounds differently.)"""
    from ditq.runtime.offload import module_bytes

    resident = load_pipeline(demo_artifacts["w8a8"], device="cpu")
    expected = _pixels(resident)
    budget = module_bytes(resident.transformer) + 1024
    pipeline = load_pipeline(demo_artifacts["w8a8"], device="cpu", offload="auto", memory_budget_bytes=budget)
    placement = pipeline.ditq_placement
    assert (placement.resident, placement.streamed) == (["transformer"], ["text_encoder"])
    assert placement.sizes["transformer"] == module_bytes(resident.transformer)
    assert placement.transfer_gbps is None  # measured on CUDA only
    assert np.abs(_pixels(pipeline) - expected).mean() < 1.0
    assert placement.demote(pipeline) == "transformer streams from pinned host memory"  # the demo has no VAE
    assert (placement.resident, placement.streamed) == ([], ["transformer", "text_encoder"])
    assert np.abs(_pixels(pipeline) - expected).mean() < 1.0
    assert placement.demote(pipeline) is None
    everything = load_pipeline(
        demo_artifacts["w8a8"], device="cpu", offload="auto"
    )  # no budget on the CPU: all stay
    assert everything.ditq_placement.streamed == []


def test_demotions_undone_leave_the_pipeline_as_it_was_placed(demo_artifacts: dict[str, Path]) -> None:
    """``Placement.restore``: the text encoder's hooks and the transformer's group offload taken off again, every
    weight resident, and the image the resident pipeline's, bit for bit."""
    from diffusers.hooks import HookRegistry

    pipeline = load_pipeline(demo_artifacts["w8a8"], device="cpu", offload="auto")  # no budget: all resident
    expected = _pixels(pipeline)
    placement = pipeline.ditq_placement
    assert placement.demote(pipeline) == "text_encoder streams from pinned host memory"
    assert placement.demote(pipeline) == "transformer streams from pinned host memory"
    assert (
        HookRegistry.check_if_exists_or_initialize(pipeline.transformer).get_hook("group_offloading")
        is not None
    )
    assert placement.restore(pipeline, 0) == [
        "transformer streams from pinned host memory",
        "text_encoder streams from pinned host memory",
    ]
    assert (placement.resident, placement.streamed, placement.steps) == (
        ["transformer", "text_encoder"],
        [],
        [],
    )
    assert not hasattr(pipeline.text_encoder, "ditq_streamed")
    registries = [getattr(m, "_diffusers_hook", None) for m in pipeline.transformer.modules()]
    assert not any(r is not None and r.hooks for r in registries)
    assert np.array_equal(_pixels(pipeline), expected)


def test_an_8bit_prefix_kv_cache_holds_the_references_in_half_the_bytes(
    demo_artifacts: dict[str, Path],
) -> None:
    from PIL import Image

    from ditq.runtime.kv_cache import install_kv_cache
    from ditq.runtime.models.qwenimage21.kv_cache import QuantizedKVLayerCache

    pipeline = load_pipeline(demo_artifacts["source"], device="cpu")
    references = [Image.new("RGB", (32, 32), (200, 40 * i, 30)) for i in range(4)]
    request = GenerationRequest(prompt="a red circle", images=references, seed=0, num_inference_steps=3, width=32, height=32)  # fmt: skip
    caches: list[object] = []

    def keep(_module: torch.nn.Module, _args: object, kwargs: dict[str, object]) -> None:
        if kwargs.get("kv_cache_mode") == "cached":
            caches.append(kwargs["kv_cache"])

    plain = np.asarray(PipelineAdapter(pipeline)(request).images[0], dtype=np.float64)
    handle = install_kv_cache(pipeline, "int8")
    watch = pipeline.transformer.register_forward_pre_hook(keep, with_kwargs=True)
    quantized = np.asarray(PipelineAdapter(pipeline)(request).images[0], dtype=np.float64)
    handle.remove()
    watch.remove()
    layers = caches[0].layer_caches  # type: ignore[attr-defined]
    assert layers and all(isinstance(layer, QuantizedKVLayerCache) for layer in layers)
    k, v = layers[0].get()  # (B, S, H, D) in the compute dtype again
    assert k.shape == v.shape and k.dtype == pipeline.transformer.dtype
    rows = k.numel() // k.shape[-1]
    assert layers[0].nbytes() == 2 * (
        k.numel() + 4 * rows
    )  # one byte a value, a float32 scale a (token, head)
    psnr = 10 * np.log10(255.0**2 / max(np.mean((plain - quantized) ** 2), 1e-12))
    assert psnr > 40, psnr
    with pytest.raises(ditq.errors.InputError, match="keeps no prefix KV cache"):
        pipeline.transformer.register_to_config(causal_condition=False)
        try:
            install_kv_cache(pipeline, "int8")
        finally:
            pipeline.transformer.register_to_config(causal_condition=True)


def test_quantized_pipeline_stays_close_to_source(demo_artifacts: dict[str, Path]) -> None:
    source = _pixels(load_pipeline(demo_artifacts["source"], device="cpu"))
    quantized = _pixels(load_pipeline(demo_artifacts["w8a8"], device="cpu"))
    assert source.shape == quantized.shape
    # Untrained weights, two steps: the images agree to a few grey levels on average, not bit for bit.
    difference = np.abs(source - quantized).mean()
    assert 0.0 < difference < 8.0, difference


def test_a_component_without_its_folder_is_one_line(demo_artifacts: dict[str, Path], tmp_path: Path) -> None:

    broken = tmp_path / "broken"
    shutil.copytree(demo_artifacts["source"], broken)
    shutil.rmtree(broken / "text_encoder")
    with pytest.raises(
        ditq.errors.InputError,
        match=r"component 'text_encoder' \(ditq.demo.text_encoder.DemoTextEncoder\) has no folder",
    ):
        load_pipeline(broken, device="cpu")


def test_unknown_offload_mode_is_refused(demo_artifacts: dict[str, Path]) -> None:
    with pytest.raises(ditq.errors.InputError, match="offload 'disk': not an offload mode"):
        load_pipeline(demo_artifacts["w8a8"], offload="disk")


def test_generate_command_prints_stages_and_writes_the_image(
    demo_artifacts: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "image.png"
    argv = [
        "generate",
        str(demo_artifacts["w8a8"]),
        "--prompt",
        "a blue square",
        "--seed",
        "0",
        "--on-collapse",
        "warn",
    ]
    code = main([*argv, "--steps", "2", "--size", "32x48", "--out", str(out), "--offload", "model"])
    printed = capsys.readouterr().out
    assert code == 0
    for line in (
        "quantized  transformer: ",
        "load ",
        "text_encoding",
        "denoising",
        "(2 steps",
        "total",
        "peak",
    ):
        assert line in printed
    from PIL import Image

    with Image.open(out) as image:
        assert image.size == (32, 48)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--size", "32by32"], "--size: expected WxH"),
        (["--size", "33x32"], "width: 33 is not a positive multiple of"),
        (["--image", "missing.png"], "missing.png: no such file"),
    ],
)
def test_generate_command_refuses_bad_input(
    demo_artifacts: dict[str, Path], extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["generate", str(demo_artifacts["w8a8"]), "--prompt", "p", "--steps", "1", *extra])
    assert code == 2
    assert message in capsys.readouterr().err


def test_a_missing_scheduler_config_is_named_not_the_output(
    demo_artifacts: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 48: the error named the --out PNG as the culprit of a scheduler folder without its config."""
    model = tmp_path / "model"
    shutil.copytree(demo_artifacts["source"], model)
    (model / "scheduler" / "scheduler_config.json").unlink()
    out = tmp_path / "x.png"
    code = main(
        ["generate", str(model), "--prompt", "p", "--steps", "1", "--size", "32x32", "--out", str(out)]
    )
    error = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(error) == 1 and "scheduler_config.json" in error[0] and str(out) not in error[0]


_MEASURE = textwrap.dedent(
    """
    import json, sys, threading
    from ditq.pipeline.open import load_pipeline

    # bfloat16, the stored precision: on the CPU the default is float32, which would double the bytes of the
    # layers kept in source precision and measure the upcast, not the loading
    load_pipeline(sys.argv[1], device="cpu", offload="model", dtype="bfloat16")  # warm-up: imports, lazy set-up
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")  # reset the kernel's peak (VmHWM) to the current resident size
        reset = True
    except OSError:
        reset = False
    base = status("VmRSS")
    sampled, done = [base], threading.Event()

    def sample():  # where the peak cannot be reset: poll the resident size instead
        while not done.wait(0.002):
            sampled.append(status("VmRSS"))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    pipeline = load_pipeline(sys.argv[2], device="cpu", offload="model", dtype="bfloat16")
    done.set()
    sampler.join()
    peak = status("VmHWM") if reset else max(sampled)
    print(json.dumps({"base": base, "peak": peak, "reset": reset, "sampled_peak": max(sampled)}))
    """
)


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="needs /proc (Linux)")
def test_host_memory_while_loading_under_model_offload(
    demo_artifacts: dict[str, Path], tmp_path: Path
) -> None:
    artifact = write_large_qwen_artifact(tmp_path / "big", 8, siblings_from=demo_artifacts["w8a8"])
    artifact_bytes = sum(p.stat().st_size for p in artifact.rglob("*") if p.is_file())
    assert artifact_bytes > 100 * 2**20  # large enough that the interpreter's noise does not matter

    measured = measure(_MEASURE, str(demo_artifacts["w8a8"]), str(artifact))
    added = measured["peak"] - measured["base"]
    # Loaded means held: the weights are resident (a lower bound keeps the measurement honest)...
    assert added > 0.8 * artifact_bytes, (added, artifact_bytes)
    # ...and nothing near a full-precision copy ever was.
    assert added <= HOST_LOAD_BOUND * artifact_bytes, (added / artifact_bytes, measured)


def test_generate_without_a_path_uses_the_bundled_demo(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from collections import Counter

    from PIL import Image

    from ditq.demo.scenes import Expectation
    from ditq.demo.scorer import score_image

    out = tmp_path / "demo.png"
    code = main(
        ["generate", "--prompt", "a green triangle on a white background", "--seed", "3", "--out", str(out)]
    )
    assert code == 0 and out.is_file()
    assert "model " in capsys.readouterr().out
    # the trained demo model, at its default 20 steps (float32 on the CPU): the picture the prompt asks for
    score = score_image(Image.open(out), Expectation("white", Counter({("triangle", "green"): 1})))
    assert score.correct, score.as_dict()


def test_generate_skip_doctor_warns(
    demo_artifacts: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    argv = ["generate", str(demo_artifacts["w8a8"]), "--prompt", "p", "--steps", "1", "--skip-doctor"]
    argv += ["--on-collapse", "warn"]  # the untrained pipeline's image is mostly transparent
    with caplog.at_level("WARNING"):
        assert main([*argv, "--out", str(tmp_path / "x.png")]) == 0
    assert any("--skip-doctor" in record.getMessage() for record in caplog.records)


def test_generate_refuses_a_collapsed_image_as_serve_does(
    demo_artifacts: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 28, item 8: an all-transparent image was written with exit 0. The untrained pipeline draws a mostly
    transparent one: the gate's transparent signature, which ditq serve refuses to return. generate refuses it
    too (exit 1, nothing written), or writes it with a warning when asked."""
    out = tmp_path / "x.png"
    argv = [
        "generate",
        str(demo_artifacts["w8a8"]),
        "--prompt",
        "p",
        "--steps",
        "1",
        "--skip-doctor",
        "--out",
        str(out),
    ]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("ditq generate: error: the generated image is collapsed and was not written: ")
    assert "transparent: opaque_fraction" in err[-1] and not out.exists()
    assert main([*argv, "--on-collapse", "warn"]) == 0 and out.exists()
