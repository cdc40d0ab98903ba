"""tools/full_size_pipeline.py at its tiny preset: builds, loads, generates, quantizes, generates again (CPU)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

import ditq
import ditq.cli
from ditq.probe.fixtures import load_fixtures
from ditq.report import validate_verdict_file
from ditq.sweep import SCHEME_STAGES

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "full_size_pipeline.py"
SIZE = 64  # the tiny preset's fixture size
STEPS = 2


def _import_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("full_size_pipeline", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


script = _import_script()


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny") / "pipeline"
    script.build(out, "tiny", device="cpu", seed=0)
    return out


@pytest.fixture(scope="module")
def quantized(source: Path) -> Path:
    out = source.with_name("pipeline-w8a8")
    ditq.quantize(source, out, "w8a8")
    return out


def _generate(directory: Path, prompt: str, references: Sequence[Image.Image]) -> dict[int, Image.Image]:
    """Number of references (0 or 2) -> the picture the pipeline in ``directory`` generates with them."""
    pipeline = ditq.load_pipeline(directory, device="cpu", dtype=torch.float32)
    return _draw(pipeline, prompt, references)


def _draw(pipeline: Any, prompt: str, references: Sequence[Image.Image]) -> dict[int, Image.Image]:
    """Number of references (0 or 2) -> the picture ``pipeline`` generates with them."""
    pictures = {}
    for count in (0, 2):
        output = pipeline(
            prompt=prompt,
            image=references[:count] or None,
            width=SIZE,
            height=SIZE,
            num_inference_steps=STEPS,
            # The pipeline scales references to output_resolution**2 pixels (1024**2 by default).
            output_resolution=SIZE,
            generator=torch.Generator().manual_seed(0),
        )
        pictures[count] = output.images[0]
    return pictures


@pytest.fixture(scope="module")
def images(source: Path, quantized: Path) -> dict[tuple[str, int], Image.Image]:
    """(model, number of references) -> the generated picture, for the source and the w8a8 artifact."""
    fixture = load_fixtures(source / "fixtures" / "fixtures.json", source / "fixtures" / "refs")["edit-2ref"]
    references = [Image.open(path) for path in fixture.reference_paths]
    # One thread: these models are tiny, and on a busy machine OpenMP's threads waiting for each other took
    # 2-4 s per call instead of 0.03 s.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {
            (name, count): picture
            for name, directory in (("source", source), ("w8a8", quantized))
            for count, picture in _generate(directory, fixture.prompt, references).items()
        }
    finally:
        torch.set_num_threads(threads)


def _edit_picture(pipeline: Any, fixture: Any) -> np.ndarray:
    """The fixture's edit at SIZE, STEPS steps, seed 0, as an array."""
    return np.asarray(
        pipeline(
            prompt=fixture.prompt,
            image=[Image.open(p) for p in fixture.reference_paths],
            width=SIZE,
            height=SIZE,
            num_inference_steps=STEPS,
            output_resolution=SIZE,
            generator=torch.Generator().manual_seed(0),
        ).images[0]
    )


def test_fixtures_follow_the_probe_format(source: Path) -> None:
    fixtures = load_fixtures(source / "fixtures" / "fixtures.json", source / "fixtures" / "refs")
    assert [len(f.references) for f in fixtures.values()] == [0, 1, 2, 3, 4]
    assert [f.mode for f in fixtures.values()] == ["generate", "edit", "edit", "edit", "edit"]
    assert {(f.width, f.height) for f in fixtures.values()} == {(SIZE, SIZE)}
    for path in {p for f in fixtures.values() for p in f.reference_paths}:
        assert Image.open(path).size == (SIZE, SIZE)


@pytest.mark.parametrize("model", ["source", "w8a8"])
@pytest.mark.parametrize("references", [0, 2])
def test_generates_a_picture(images: dict[tuple[str, int], Image.Image], model: str, references: int) -> None:
    picture = np.asarray(images[model, references])
    assert picture.shape[:2] == (SIZE, SIZE)
    assert np.unique(picture.reshape(-1, picture.shape[-1]), axis=0).shape[0] > 1, "every pixel is the same"


@pytest.mark.parametrize("references", [0, 2])
def test_w8a8_tracks_the_source(images: dict[tuple[str, int], Image.Image], references: int) -> None:
    reference = np.asarray(images["source", references], dtype=np.float64)
    quantized = np.asarray(images["w8a8", references], dtype=np.float64)
    mean_squared_error = np.mean((reference - quantized) ** 2)
    assert mean_squared_error > 0, "the w8a8 picture is the source's, bit for bit: nothing ran quantized"
    psnr = 10 * np.log10(255.0**2 / mean_squared_error)
    assert psnr > 50, f"PSNR {psnr:.1f} dB"  # about 70 dB here; 0 vs 2 references differ by about 54 dB


def test_references_change_the_picture(images: dict[tuple[str, int], Image.Image]) -> None:
    assert not np.array_equal(np.asarray(images["source", 0]), np.asarray(images["source", 2]))


def test_artifact_verifies_and_quantizes_every_block_linear(source: Path, quantized: Path) -> None:
    report = ditq.verify(quantized, source)
    assert report.ok, report.table()
    components = json.loads((quantized / "MANIFEST.json").read_text())["components"]
    transformer, text_encoder = components["transformer"], components["text_encoder"]
    assert len(transformer["quantized"]) == 2 * 7  # blocks x (q, k, v, out, MLP proj, gate, out)
    # Qwen3-VL: 2 language layers x (q, k, v, o, gate, up, down), 2 vision blocks x (qkv, proj, fc1, fc2) and
    # 2 deepstack mergers x (fc1, fc2): the three repeated block lists
    assert len(text_encoder["quantized"]) == 2 * 7 + 2 * 4 + 2 * 2
    assert text_encoder["block_lists"] == [
        "model.visual.blocks", "model.visual.deepstack_merger_list", "model.language_model.layers"
    ]  # fmt: skip
    for component in (transformer, text_encoder):
        assert not [name for name, reason in component["ignored"].items() if reason.startswith("shape guard")]


def test_auto_quantizes_the_transformer_and_the_text_encoder(quantized: Path) -> None:
    """--components auto (the default): every component whose block Linears hold 5 % of the pipeline's parameters;
    the VAE's blocks hold none. The share of each is recorded."""
    options = json.loads((quantized / "MANIFEST.json").read_text())["options"]
    assert options["components"] == ["text_encoder", "transformer"]
    shares = options["components_rule"]["auto"]["shares"]
    assert shares["vae"] == 0 and shares["transformer"] > 0.05 and shares["text_encoder"] > 0.05


def test_the_text_encoders_head_is_declared_unused_and_never_loaded(
    source: Path, quantized: Path, tmp_path: Path
) -> None:
    """QwenImage21Pipeline reads the text encoder's hidden states: its lm_head (vocabulary x hidden) is declared
    unused, not loaded, and the images are bit for bit those of the same artifact with the head loaded."""
    unused = json.loads((quantized / "MANIFEST.json").read_text())["unused"]
    assert unused == {"text_encoder": {"lm_head": {
        "reason": "output head: QwenImage21Pipeline reads the text encoder's hidden states, never its logits",
        "params": script.TOKENIZER_VOCAB_SIZE * 64, "bytes": script.TOKENIZER_VOCAB_SIZE * 64 * 2,
    }}}  # fmt: skip
    dropped = ditq.load_pipeline(quantized, device="cpu", dtype=torch.float32)
    kept = ditq.load_pipeline(quantized, device="cpu", dtype=torch.float32, drop_unused=False)
    assert dropped.ditq_unused == {"text_encoder.lm_head": script.TOKENIZER_VOCAB_SIZE * 64 * 2}
    assert not [n for n, _ in dropped.text_encoder.named_parameters() if n.startswith("lm_head")]
    assert kept.text_encoder.lm_head.weight.shape == (script.TOKENIZER_VOCAB_SIZE, 64)
    fixture = load_fixtures(source / "fixtures" / "fixtures.json", source / "fixtures" / "refs")["edit-1ref"]
    assert np.array_equal(_edit_picture(dropped, fixture), _edit_picture(kept, fixture))
    # A caller that reads the logits gets an error naming the module, never numbers nobody computed.
    output = dropped.text_encoder(input_ids=torch.tensor([[1, 2, 3]]))
    with pytest.raises(
        ditq.errors.DitqError, match=r"text_encoder\.lm_head is declared unused .* --keep-unused"
    ):
        output.logits.argmax(-1)
    # --keep-unused declares nothing
    kept_artifact = tmp_path / "kept"
    assert ditq.quantize(source, kept_artifact, "fp8", keep_unused=True).manifest["unused"] == {}


def test_doctor_and_generate_run_the_quantized_text_encoder(quantized: Path, tmp_path: Path) -> None:
    from ditq.cli import main

    assert main(["doctor", "--artifact", str(quantized), "--rows", "8"]) == 0
    source_refs = quantized / "fixtures" / "refs"
    out = tmp_path / "edit.png"
    code = main(["generate", str(quantized), "--device", "cpu", "--prompt", "a red star", "--steps", "2",
                 "--size", f"{SIZE}x{SIZE}", "--image", str(source_refs / "ref-star-red.png"), "--out", str(out),
                 "--on-collapse", "warn"])  # fmt: skip
    assert code == 0 and Image.open(out).size == (SIZE, SIZE)


def test_same_seed_same_bytes(source: Path, tmp_path: Path) -> None:
    again = tmp_path / "again"
    script.build(again, "tiny", device="cpu", seed=0)
    for path in sorted(source.rglob("*.safetensors")):
        assert (again / path.relative_to(source)).read_bytes() == path.read_bytes(), path.name


def test_refuses_an_existing_directory(source: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert script.main(["--preset", "tiny", "--out", str(source)]) == 2
    assert "already exists" in capsys.readouterr().err


def test_auto_offload_streams_the_qwen3_vl_text_encoder_through_its_nested_blocks(quantized: Path) -> None:
    """Under a budget that holds the transformer and the VAE only, the text encoder streams: hooks on the blocks of
    its vision tower, deepstack mergers and language model, wherever they nest; the picture is the resident one."""
    from ditq.runtime.offload import module_bytes

    resident = ditq.load_pipeline(quantized, device="cpu", dtype=torch.float32)
    budget = module_bytes(resident.transformer) + module_bytes(resident.vae) + 1024
    streamed = ditq.load_pipeline(
        quantized, device="cpu", dtype=torch.float32, offload="auto", memory_budget_bytes=budget
    )
    placement = streamed.ditq_placement
    assert (placement.resident, placement.streamed) == (["transformer", "vae"], ["text_encoder"])
    hooked = {name for name, m in streamed.text_encoder.named_modules() if m._forward_pre_hooks}
    assert {
        "",
        "model.visual.blocks.0",
        "model.visual.deepstack_merger_list.1",
        "model.language_model.layers.1",
    } <= hooked
    fixture = load_fixtures(quantized / "fixtures" / "fixtures.json", quantized / "fixtures" / "refs")[
        "edit-1ref"
    ]
    assert np.array_equal(_edit_picture(resident, fixture), _edit_picture(streamed, fixture))


def test_the_prefix_cache_is_let_go_when_the_vae_begins_decoding(source: Path) -> None:
    """The prefix KV cache is emptied before the VAE decodes (it is held through the decode otherwise): the same
    pixels, every block's keys and values released, and the adapter does it on every call."""
    from ditq.runtime.adapter import GenerationRequest, PipelineAdapter
    from ditq.runtime.prefix_release import released_at_decode

    pipeline = ditq.load_pipeline(source, device="cpu", dtype=torch.float32)
    fixture = load_fixtures(source / "fixtures" / "fixtures.json", source / "fixtures" / "refs")["edit-2ref"]
    caches: dict[int, Any] = {}
    at_decode: list[tuple[int, int]] = []  # per call: (blocks whose keys are held, their bytes)

    def remember(_module: Any, _args: Any, kwargs: dict[str, Any]) -> None:
        caches[id(kwargs["kv_cache"])] = kwargs["kv_cache"]

    decode = pipeline.vae.decode

    def spy(*args: Any, **kwargs: Any) -> Any:
        layers = [layer for cache in caches.values() for layer in cache.layer_caches if layer.k is not None]
        at_decode.append(
            (len(layers), sum(t.numel() * t.element_size() for la in layers for t in (la.k, la.v)))
        )
        caches.clear()
        return decode(*args, **kwargs)

    handle = pipeline.transformer.register_forward_pre_hook(remember, with_kwargs=True)
    pipeline.vae.decode = spy
    try:
        kept = _edit_picture(pipeline, fixture)
        with released_at_decode(pipeline) as record:
            released = _edit_picture(pipeline, fixture)
        PipelineAdapter(pipeline)(
            GenerationRequest(
                prompt=fixture.prompt,
                images=[Image.open(fixture.reference_paths[0])],
                width=SIZE,
                height=SIZE,
                num_inference_steps=STEPS,
                seed=0,
            )
        )
    finally:
        handle.remove()
        del pipeline.vae.decode
    blocks = len(pipeline.transformer.transformer_blocks)
    (held, held_bytes), after_release, after_adapter = at_decode
    assert held == blocks and held_bytes > 0  # without the release every block's cache is held at decode
    assert after_release == after_adapter == (0, 0)
    assert record.released_bytes == held_bytes
    assert np.array_equal(kept, released)
    assert "decode" not in vars(pipeline.vae)  # the shadow is gone after the call


def test_an_auto_placement_tiles_the_vae_only_where_the_vae_ran_out_of_memory(source: Path) -> None:
    """A call that runs out of memory says in which stage; tiling the VAE is the next step only where that stage
    was the VAE's (it frees nothing in the text encoder or the transformer), else the next component streams."""
    from ditq.runtime.adapter import GenerationRequest, PipelineAdapter

    pipeline = ditq.load_pipeline(
        source, device="cpu", dtype=torch.float32, offload="auto", memory_budget_bytes=2**40
    )
    placement = pipeline.ditq_placement
    assert placement.resident == ["transformer", "vae", "text_encoder"] and not placement.vae_tiling
    adapter = PipelineAdapter(pipeline)
    request = GenerationRequest(
        prompt="a red star", width=SIZE, height=SIZE, num_inference_steps=STEPS, seed=0
    )

    def out_of_memory(*_args: Any, **_kwargs: Any) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory (test)")

    def stage_that_ran_out() -> str | None:
        with pytest.raises(torch.OutOfMemoryError) as raised:
            adapter(request)
        return adapter.failed_stage(raised.value)

    handle = pipeline.transformer.transformer_blocks[0].register_forward_pre_hook(out_of_memory)  # inside it
    try:
        stage = stage_that_ran_out()
    finally:
        handle.remove()
    assert stage == "denoising_forward"
    assert placement.demote(pipeline, stage) == "text_encoder streams from pinned host memory"
    assert not placement.vae_tiling

    pipeline.vae.decode = out_of_memory
    try:
        stage = stage_that_ran_out()
    finally:
        del pipeline.vae.decode
    assert stage == "decoding"
    assert placement.demote(pipeline, stage) == "the VAE decodes in tiles" and placement.vae_tiling
    # and it runs, tiled, with the text encoder streamed
    assert adapter(request).images[0].size == (SIZE, SIZE)


def test_transformers_loads_the_quantized_qwen3_vl_text_encoder(source: Path, quantized: Path) -> None:
    """transformers' own from_pretrained reads the compressed-tensors text encoder (its config group, its
    decompressor) and its last hidden state stays close to the source's, as ditq's own loading does."""
    import transformers

    from ditq.numerics import relative_l2

    ids = torch.tensor([[5, 17, 40, 3, 99, 250, 7, 12]])

    def last_hidden(model: torch.nn.Module) -> torch.Tensor:
        with torch.inference_mode():
            return model(input_ids=ids, output_hidden_states=True).hidden_states[-1]

    cls = transformers.Qwen3VLForConditionalGeneration
    reference = last_hidden(cls.from_pretrained(str(source / "text_encoder"), dtype=torch.float32))
    theirs = last_hidden(cls.from_pretrained(str(quantized / "text_encoder"), dtype=torch.float32))
    ours = last_hidden(ditq.load_component(quantized, "text_encoder", dtype=torch.float32))
    assert 0 < relative_l2(theirs, reference) < 0.05 and 0 < relative_l2(ours, reference) < 0.05


def test_serve_answers_an_edit_with_the_quantized_text_encoder(quantized: Path) -> None:
    from fastapi.testclient import TestClient

    from ditq.pipeline.open import open_pipeline
    from ditq.runtime.options import LoadOptions
    from ditq.serve import ServeConfig, create_app
    from ditq.serve.startup import make_doctor

    config = ServeConfig(served_model_name="tiny", on_collapse="warn")

    def load() -> Any:
        return open_pipeline(quantized, LoadOptions(device="cpu", offload="auto", dtype="float32"))

    app = create_app(config, load=load, doctor=make_doctor(), model_root="tiny")
    reference = (quantized / "fixtures" / "refs" / "ref-star-red.png").read_bytes()
    with TestClient(app) as client:
        assert app.state.serve.wait_loaded(120)
        health = client.get("/health").json()
        assert health["status"] == "ready" and health["unused"] == {"text_encoder.lm_head": 2048 * 64 * 2}
        assert health["quantized"] == {"text_encoder": {"w8a8": 26}, "transformer": {"w8a8": 14}}
        assert (
            health["placement"]["resident"] and health["placement"]["streamed"] == []
        )  # no budget on the CPU
        # one step: Qwen-Image's scheduler divides by zero there (a NaN image), refused before the queue
        one = client.post("/v1/images/generations", json={"prompt": "a red star", "num_inference_steps": 1})
        assert one.status_code == 400, one.text
        assert one.json()["error"]["param"] == "num_inference_steps"
        assert (
            "scheduler (FlowMatchEulerDiscreteScheduler) computes a NaN or infinite sigma at 1 step"
            in one.json()["error"]["message"]
        )
        response = client.post(
            "/v1/images/edits",
            data={"prompt": "a red star", "size": f"{SIZE}x{SIZE}", "num_inference_steps": "2", "seed": "0"},
            files=[("image[]", ("star.png", reference, "image/png"))],
        )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["input_images"] == 1


def test_a_compiled_pipeline_serves_any_prompt_length_and_reference_layout_from_the_graphs_it_has(
    quantized: Path,
) -> None:
    """Under --compile the blocks' graphs are dynamic from the first call: once a path has run (here: 2 references),
    a request with another prompt length, other reference sizes or another number of references compiles nothing.
    Dynamo's default kept sizes, duck-shaped equalities and the prefix boundary (a slice) as constants, and a
    4-reference request recompiled for 10-13 s on the H200; the pixels stay the eager pipeline's."""
    from torch._dynamo.utils import counters

    from ditq.runtime.compile import compile_pipeline

    fixture = load_fixtures(
        source_fixtures := quantized / "fixtures" / "fixtures.json", source_fixtures.parent / "refs"
    )["edit-2ref"]
    wide = [Image.open(p).resize((SIZE, SIZE // 2)) for p in fixture.reference_paths]

    def draw(pipeline: Any, prompt: str, references: list[Image.Image] | None) -> np.ndarray:
        return np.asarray(
            pipeline(prompt=prompt, image=references, width=SIZE, height=SIZE, num_inference_steps=STEPS,
                     output_resolution=SIZE, generator=torch.Generator().manual_seed(0)).images[0]
        )  # fmt: skip

    eager = ditq.load_pipeline(quantized, device="cpu", dtype=torch.float32)
    compiled = ditq.load_pipeline(quantized, device="cpu", dtype=torch.float32)
    torch._dynamo.reset()
    compile_pipeline(compiled, "eager")  # the transformer only (its text encoder: the tests below)
    square = [Image.open(p) for p in fixture.reference_paths]
    start = counters["stats"]["unique_graphs"]
    draw(compiled, fixture.prompt, square)  # the first call at 2 references compiles its paths
    before = counters["stats"]["unique_graphs"]
    # two paths, two graphs: the prefix step and the cached steps (every block's, the first block's hidden states
    # included although they are a view into the joint sequence); and the VAE's decoder, one graph
    assert before - start == 3
    longer = fixture.prompt + " Keep the light soft and the shadows long."
    picture = draw(compiled, longer, wide)
    assert counters["stats"]["unique_graphs"] == before, (
        "a new prompt length or reference size compiled again"
    )
    assert np.array_equal(picture, draw(eager, longer, wide))
    # other reference counts: the same prefix graph (ditq.runtime.models.qwenimage21.prefill)
    for references in (None, square[:1]):
        draw(compiled, fixture.prompt, references)
        assert counters["stats"]["unique_graphs"] == before, f"{references!r:.40} compiled again"


def test_compile_takes_the_text_encoders_decoder_layers_and_leaves_its_vision_tower(
    source: Path, quantized: Path, images: dict[tuple[str, int], Image.Image]
) -> None:
    """--compile compiles Qwen3-VL's language-model layers (not its vision blocks; here quantized, w8a8) with its
    KV cache off: the same pixels as eager (``images``: the eager w8a8 pictures of this prompt and seed), with and
    without references, and no graph for a longer prompt, other reference sizes or per layer."""
    from ditq.runtime.compile import compiled_graphs

    fixture = load_fixtures(source / "fixtures" / "fixtures.json", source / "fixtures" / "refs")["edit-2ref"]
    references = [Image.open(path) for path in fixture.reference_paths]
    torch._dynamo.reset()
    # as --compile --compile-backend aot_eager loads it
    pipeline = ditq.load_pipeline(quantized, device="cpu", dtype=torch.float32, compile="aot_eager")
    facts = pipeline.ditq_compile
    encoder = pipeline.text_encoder
    layers = encoder.model.language_model.layers
    assert facts.module == "transformer, text_encoder, vae"
    assert f"; text_encoder: repeated blocks ({len(layers)} x Qwen3VLTextDecoderLayer); " in facts.how
    assert facts.how.endswith("; vae: decoder (QwenImage21Decoder3d)")
    assert all(layer._compiled_call_impl is not None for layer in layers)
    assert all(block._compiled_call_impl is None for block in encoder.model.visual.blocks)
    assert encoder.model.language_model.config.use_cache is False
    for count, picture in _draw(pipeline, fixture.prompt, references).items():
        # the traced VAE decoder's decompositions (F.normalize, the upsampling) round differently from eager's:
        # at most one level of 255 (the decode alone: tests/runtime/test_compile.py)
        difference = np.abs(np.asarray(picture).astype(np.int16) - np.asarray(images["w8a8", count]))
        assert difference.max() <= 1 and difference.mean() <= 0.01, count
    graphs = compiled_graphs()
    longer = fixture.prompt + " on a long wooden table by a window, late in the day"
    wide = [picture.resize((SIZE, SIZE // 2)) for picture in references]
    with torch.no_grad():  # as the pipeline's call runs (grad mode is part of a graph's guards)
        for images in (None, wide[:1]):
            pipeline.encode_prompt(longer, image=images, device="cpu")
    # the prompt's length and the references' tokens are dynamic sizes; the layer index is not read
    assert compiled_graphs() == graphs


def test_compile_leaves_a_bf16_text_encoder_eager(source: Path) -> None:
    """--compile on a pipeline whose text encoder is not quantized compiles the transformer (and the VAE's decoder)
    only: a BF16 encoder's compiled layers ran slower than eager on the GPU (docs/results.md, "Served speed")."""
    torch._dynamo.reset()
    pipeline = ditq.load_pipeline(source, device="cpu", dtype=torch.float32, compile="aot_eager")
    assert pipeline.ditq_compile.module == "transformer, vae"
    layers = pipeline.text_encoder.model.language_model.layers
    assert all(layer._compiled_call_impl is None for layer in layers)
    assert all(block._compiled_call_impl is not None for block in pipeline.transformer.transformer_blocks)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_inductor_compiles_the_quantized_text_encoder_on_cuda_to_the_pixels_of_eager(
    source: Path, quantized: Path
) -> None:
    """load_pipeline(compile="inductor"), as --compile loads: the text encoder's decoder layers compiled by inductor
    with ditq's 8-bit kernels on the GPU draw the eager pixels, and a longer prompt or other reference sizes
    compile no graph in the encoder."""
    from ditq.runtime.compile import compiled_graphs

    fixture = load_fixtures(source / "fixtures" / "fixtures.json", source / "fixtures" / "refs")["edit-2ref"]
    references = [Image.open(path) for path in fixture.reference_paths]
    eager = ditq.load_pipeline(quantized, device="cuda")
    expected = _draw(eager, fixture.prompt, references)
    del eager
    torch._dynamo.reset()
    pipeline = ditq.load_pipeline(quantized, device="cuda", compile="inductor")
    assert pipeline.ditq_compile.module == "transformer, text_encoder, vae"
    for count, picture in _draw(pipeline, fixture.prompt, references).items():
        # inductor fuses and reorders float arithmetic: close to eager, not bit for bit
        difference = np.abs(
            np.asarray(picture, dtype=np.float64) - np.asarray(expected[count], dtype=np.float64)
        )
        assert difference.mean() < 1.0, (count, difference.mean())
    graphs = compiled_graphs()
    longer = fixture.prompt + " on a long wooden table by a window, late in the day"
    wide = [picture.resize((SIZE, SIZE // 2)) for picture in references]
    with torch.no_grad():
        for images in (None, wide[:1]):
            pipeline.encode_prompt(longer, image=images, device="cuda")
    assert compiled_graphs() == graphs


def test_one_step_is_refused_before_any_request_or_server_runs(
    source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Qwen-Image's scheduler stretches its shift to a terminal value, which divides by zero at one step
    fixtures = source / "fixtures"
    argv = ["quantize", str(source), str(tmp_path / "out"), "--scheme", "w4a8", "--calibrate", "gptq", "--fixtures",
            str(fixtures / "fixtures.json"), "--refs", str(fixtures / "refs"), "--calibration-steps", "1",
            "--device", "cpu"]  # fmt: skip
    assert ditq.cli.main(argv) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("ditq quantize: error: --calibration-steps 1: the model's scheduler ")
    assert "computes a NaN or infinite sigma at 1 step" in error
    assert not (tmp_path / "out").exists() and not (tmp_path / ".ditq-resume-out").exists()
    # a sweep says so from the scheduler's config, before its baseline runs
    sweep = ["sweep", str(source), "--schemes", "w4a8", "--calibrate", "gptq", "--calibration-steps", "1",
             "--fixtures", str(fixtures / "fixtures.json"), "--refs", str(fixtures / "refs"), "--out",
             str(tmp_path / "sweep"), "--device", "cpu"]  # fmt: skip
    assert ditq.cli.main(sweep) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("ditq sweep: error: --calibration-steps 1: the model's scheduler ")
    # and the probes' own steps, which every server would refuse
    assert ditq.cli.main([*sweep[:4], *sweep[8:], "--steps", "1"]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("ditq sweep: error: --steps 1: the model's scheduler ")
    assert not (tmp_path / "sweep").exists()
    # ditq generate: once the model is open, before the image is drawn (it would be NaN, all black)
    generate = ["generate", str(source), "--prompt", "a red star", "--steps", "1", "--out", str(tmp_path / "one.png"),
                "--device", "cpu"]  # fmt: skip
    assert ditq.cli.main(generate) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith(
        "ditq generate: error: --steps 1: the model's scheduler (FlowMatchEulerDiscreteScheduler) computes a NaN"
    )
    assert not (tmp_path / "one.png").exists()


@pytest.mark.slow
def test_ditq_sweep_runs_the_tiny_qwen_image_pipeline_on_the_cpu(source: Path, tmp_path: Path) -> None:
    """The README's main job on the tiny Qwen-Image pipeline, on the CPU, where torchvision is not installed: the
    Qwen3-VL processor loads from its image processor and tokenizer (an edit's reference goes through it), every
    stage of the baseline and of w8a8 ends
    ok, and the report answers, each UNDECIDED answer that a further run can settle with the command for it."""
    chosen = {
        k: v
        for k, v in json.loads((source / "fixtures" / "fixtures.json").read_text()).items()
        if k == "edit-1ref"
    }
    fixtures = tmp_path / "fixtures.json"
    fixtures.write_text(json.dumps(chosen))
    out = tmp_path / "sweep"
    argv = [sys.executable, "-m", "ditq.cli", "sweep", str(source), "--schemes", "w4a8", "--calibrate", "gptq",
            "--calibration-seeds", "0", "--calibration-steps", "2", "--fixtures", str(fixtures),
            "--refs", str(source / "fixtures" / "refs"), "--seeds", "1-2", "--steps", str(STEPS), "--device", "cpu",
            "--out", str(out), "--note", "random weights: deviation, not quality"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert importlib.util.find_spec("torchvision") is None  # what this test is for: it ran without it
    candidate = json.loads((out / "w4a8-gptq" / "CANDIDATE.json").read_text())
    assert {stage: entry["status"] for stage, entry in candidate["stages"].items()} == dict.fromkeys(
        SCHEME_STAGES, "ok"
    )
    # the doctor checks the dtype the CPU's servers compute in
    assert "--dtype float32" in candidate["stages"]["doctor"]["command"]
    document = validate_verdict_file(out / "report" / "verdict.json")
    (verdict,) = document.candidates
    answers = [
        verdict.objectives.faster,
        verdict.objectives.smaller,
        *verdict.objectives.fit_by_standard.values(),
    ]
    # a baseline whose own images collapse (random weights draw transparent pictures) no further run settles
    settleable = [a for a in answers if a.answer == "UNDECIDED" and a.reasons[0].code != "baseline_collapsed"]
    assert verdict.objectives.faster in settleable  # timed on a CPU: the same sweep on a GPU answers it
    assert all(a.settle_command for a in settleable)
    assert "--device cuda" in (verdict.objectives.faster.settle_command or "")
    assert "random weights: deviation, not quality" in (out / "report" / "REPORT.md").read_text()


@pytest.mark.skipif(
    importlib.util.find_spec("torchvision") is not None, reason="torchvision is installed here"
)
def test_the_qwen3_vl_processor_loads_without_torchvision_and_a_class_that_needs_it_is_one_line(
    source: Path,
) -> None:
    """The pipeline's processor is transformers' Qwen3VLProcessor, built from its image processor and tokenizer;
    a class that does need torchvision is refused in one line that says how to install it."""
    from transformers import Qwen3VLVideoProcessor

    from ditq.runtime.processors import TORCHVISION_HINT, missing_library

    pipeline = ditq.load_pipeline(source, device="cpu", dtype=torch.float32)
    processor = pipeline.processor
    assert type(processor).__name__ == "Qwen3VLProcessor" and not hasattr(processor, "video_processor")
    assert (
        type(processor.image_processor).__name__ == "Qwen2VLImageProcessorPil"
    )  # transformers' own fallback
    with pytest.raises(ImportError) as caught:
        Qwen3VLVideoProcessor.from_pretrained(str(source / "processor"))
    where = source / "model_index.json"
    assert str(missing_library(caught.value, where)) == (
        f"{where}: Qwen3VLVideoProcessor needs torchvision, which is not installed: {TORCHVISION_HINT}"
    )


def test_diffusers_own_step_cache_runs_in_its_pipelines_guidance_contexts_on_an_artifact(
    quantized: Path,
) -> None:
    """diffusers' Qwen-Image-2.1 pipeline opens a cache context per guidance branch ("cond", "uncond"), and its own
    ``enable_cache(FirstBlockCacheConfig(...))`` runs on the w8a8 artifact's quantized blocks once ``import
    ditq.diffusers`` has made them known to its block registry: threshold 0 changes no pixel, a threshold nothing
    stays above computes the last block for each branch's first call only. Run without the prefix KV cache
    (``use_kv_cache=False``): with it the pipeline runs its extract and cached calls in one context, whose residuals
    differ in length, and diffusers' hook fails on any Qwen-Image-2.1 model, quantized or not (``--cache`` gives each
    kind of call its own context)."""
    from diffusers import FirstBlockCacheConfig

    import ditq.diffusers  # the model family's blocks in diffusers' block registry

    pipeline = ditq.load_pipeline(quantized, device="cpu", dtype=torch.float32)
    computed: list[int] = []
    pipeline.transformer.transformer_blocks[-1].attn.register_forward_hook(lambda *_: computed.append(1))
    steps = 4

    def draw(threshold: float | None) -> tuple[np.ndarray, int]:
        if threshold is not None:
            pipeline.transformer.enable_cache(FirstBlockCacheConfig(threshold=threshold))
        computed.clear()
        image = pipeline(
            prompt="a red square", negative_prompt="blue", true_cfg_scale=4.0, width=SIZE, height=SIZE,
            output_resolution=SIZE, num_inference_steps=steps, use_kv_cache=False,
            generator=torch.Generator().manual_seed(0),
        ).images[0]  # fmt: skip
        if threshold is not None:
            pipeline.transformer.disable_cache()
        return np.asarray(image, dtype=np.int16), len(computed)

    plain, plain_calls = draw(None)
    assert plain_calls == 2 * steps  # cond and uncond, every step
    zero, zero_calls = draw(0.0)
    assert zero_calls == 2 * steps and np.array_equal(zero, plain)
    skipping, skipping_calls = draw(1e9)
    assert skipping_calls == 2 and np.abs(skipping - plain).max() > 0


def test_a_calibration_runs_the_source_text_encoder_in_every_pass(source: Path, tmp_path: Path) -> None:
    """GPTQ over two components (``--components auto``: the text encoder, then the transformer): every component is
    rounded before any is swapped, so every request of every pass runs the source text encoder and the transformer's
    Hessians come from its prompt embeddings; the artifact is then written and verifies. (Swapped in first, the
    quantized text encoder ran in the transformer's passes: resident, its first forward's repack let go of the
    tensors the artifact is written from; streamed on CUDA, its layers, held on the host to be saved, could not run,
    where an H100 at full size stopped.)"""
    from ditq.calibration import CalibrationOptions, calibration_for
    from ditq.pipeline.open import open_pipeline
    from ditq.runtime.modules import quantized_linears
    from ditq.runtime.options import LoadOptions

    fixtures = source / "fixtures"
    # one fixture with references: the text encoder's vision tower runs too (each request takes seconds on the CPU)
    options = CalibrationOptions(
        fixtures / "fixtures.json", fixtures / "refs", seeds=(0,), steps=STEPS, only=("edit-1ref",)
    )
    adapter = open_pipeline(source, LoadOptions(device="cpu"))
    pipeline = adapter.pipeline
    ran_quantized: list[bool] = []
    hook = pipeline.text_encoder.register_forward_pre_hook(
        lambda module, _: ran_quantized.append(bool(quantized_linears(module)))
    )
    try:
        ditq.quantize_(pipeline, "w4a8", calibration=calibration_for(adapter, options))
    finally:
        hook.remove()
    assert len(ran_quantized) >= 2 and not any(ran_quantized)  # its own pass and the transformer's
    assert quantized_linears(pipeline.text_encoder) and quantized_linears(pipeline.transformer)
    out = tmp_path / "artifact"
    ditq.save(pipeline, out)
    report = ditq.verify(out, source)
    assert report.ok, report.table()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_streamed_cuda_calibration_of_both_components_writes_an_artifact_that_verifies(
    source: Path, tmp_path: Path
) -> None:
    """The same two components on CUDA with nothing resident (``--offload auto`` under a 1-byte budget): the text
    encoder's layers wait on the host to be saved while the transformer's requests run the source one."""
    from ditq.calibration import CalibrationOptions, calibrate_and_save
    from ditq.runtime.options import LoadOptions

    fixtures = source / "fixtures"
    load = LoadOptions(device="cuda", offload="auto", memory_budget_bytes=1)
    options = CalibrationOptions(
        fixtures / "fixtures.json", fixtures / "refs", seeds=(0,), steps=STEPS, only=("edit-1ref",), load=load
    )
    out = tmp_path / "streamed"
    calibrate_and_save(source, out, "w4a8", options)
    report = ditq.verify(out, source)
    assert report.ok, report.table()


def test_the_slim_preset_has_the_full_widths_with_two_of_each_stack_of_layers() -> None:
    """Built on the meta device (no memory, no files): every Linear of the slim preset has a full-size one's
    shape, and it is two blocks, two text layers and two vision blocks deep."""
    full, slim = script.dry_run(script.PRESETS["full"]), script.dry_run(script.PRESETS["slim"])
    assert slim["vae"] == full["vae"]
    tokenizer = script.build_tokenizer()

    def linear_shapes(preset: str) -> dict[str, set[tuple[int, int]]]:
        shapes: dict[str, set[tuple[int, int]]] = {}
        for name, builder in script.model_builders(script.PRESETS[preset], tokenizer).items():
            with torch.device("meta"):
                model = builder()
            shapes[name] = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)}
        return shapes

    assert linear_shapes("slim") == linear_shapes("full")
    preset = script.PRESETS["slim"]
    assert preset.transformer["num_layers"] == 2
    assert preset.text_config["num_hidden_layers"] == 2 and preset.vision_config["depth"] == 2
    assert (
        2 / 32 < slim["transformer"]["parameters"] / full["transformer"]["parameters"] < 0.1
    )  # 2 of 32 blocks
