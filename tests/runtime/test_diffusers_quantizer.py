"""diffusers' own ``from_pretrained``, after ``import ditq.diffusers``, loads compressed-tensors components into
ditq's QuantizedLinears: the same tensors and the same outputs, bit for bit, as ``ditq.load_pipeline`` and
``load_component``; ditq's artifacts (each scheme, and a mixed plan) and llm-compressor's checkpoints alike."""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import DiffusionPipeline, FluxTransformer2DModel, QwenImage21Transformer2DModel
from safetensors.torch import load_file, save_file
from tiny_models import LLMC_SCHEMES, example_inputs, llmc_pipeline_dir

import ditq.diffusers
from ditq.errors import InputError
from ditq.pipeline.open import load_pipeline
from ditq.runtime.loader import load_component, stored_layer_schemes
from ditq.runtime.modules import quantized_linears
from runtime.artifacts import write_large_qwen_artifact
from runtime.host_memory import measure

SCHEMES = ("w8a8", "w8a16", "fp8", "w4a16", "w4a8")
CUDA_SCHEMES = ("w8a8", "w8a16", "fp8")  # the 4-bit schemes have no CUDA kernel path yet
WEIGHTS = "transformer/diffusion_pytorch_model.safetensors"


def _image(pipeline: Any) -> torch.Tensor:
    """Two seeded denoising steps of the demo pipeline at 32x32, as the float tensor it returns."""
    generator = torch.Generator().manual_seed(0)
    out = pipeline(
        "a red circle", num_inference_steps=2, height=32, width=32, generator=generator, output_type="pt"
    )
    return out.images


def _forward(transformer: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """One seeded forward of the tiny demo transformer: a 4x4 latent of 64 channels after 5 text tokens of 32."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        return transformer(
            hidden_states=torch.randn(1, 16, 64, generator=generator).to(dtype),
            encoder_hidden_states=torch.randn(1, 5, 32, generator=generator).to(dtype),
            timestep=torch.tensor([0.5]),
            img_shapes=[[(1, 4, 4)]],
            img_mask=torch.tensor([[False] * 5 + [True] * 4]),
            return_dict=False,
        )[0]


def _same_tensors(got: torch.nn.Module, expected: torch.nn.Module) -> None:
    """The two modules hold the same tensors under the same names, in the same dtypes, equal bit for bit."""
    got_state, expected_state = got.state_dict(), expected.state_dict()
    assert got_state.keys() == expected_state.keys()
    for name, tensor in expected_state.items():
        assert got_state[name].dtype == tensor.dtype, name
        assert torch.equal(got_state[name], tensor), name


@pytest.mark.parametrize("scheme", SCHEMES)
def test_diffusion_pipeline_from_pretrained_draws_what_load_pipeline_draws(
    demo_artifacts: dict[str, Path], scheme: str
) -> None:
    pipeline = DiffusionPipeline.from_pretrained(demo_artifacts[scheme])
    assert type(pipeline).__name__ == "DitqDemoPipeline"  # the class model_index.json names, from ditq.demo
    layers = quantized_linears(pipeline.transformer)
    assert layers and {layer.scheme.name for layer in layers.values()} == {scheme}
    expected = load_pipeline(demo_artifacts[scheme], device="cpu")
    assert torch.equal(_image(pipeline), _image(expected))


def test_a_transformer_from_pretrained_holds_the_stored_tensors_and_nothing_else(
    demo_artifacts: dict[str, Path],
) -> None:
    """No weight of a quantized layer in source precision: each stored layer is its scheme's QuantizedLinear, and
    the model's state is exactly the file's tensors (float32 load of a float32 source: nothing is cast)."""
    artifact = demo_artifacts["w8a16"]
    model = QwenImage21Transformer2DModel.from_pretrained(artifact, subfolder="transformer")
    layers = quantized_linears(model)
    assert {prefix: layer.scheme for prefix, layer in layers.items()} == stored_layer_schemes(
        artifact, "transformer"
    )
    for layer in layers.values():
        held = {name for name, _ in layer.named_parameters()} | {name for name, _ in layer.named_buffers()}
        assert held == {"weight_packed", "weight_scale", "weight_shape"}  # the demo's block Linears: no bias
    stored = load_file(str(artifact / WEIGHTS))
    state = model.state_dict()
    assert state.keys() == stored.keys()
    assert all(state[n].dtype == t.dtype and torch.equal(state[n], t) for n, t in stored.items())
    expected = load_component(artifact, "transformer", device="cpu", dtype=torch.float32)
    assert torch.equal(_forward(model, torch.float32), _forward(expected, torch.float32))
    with pytest.raises(ValueError, match="not serializable"):  # the artifact on disk is the serialized form
        model.save_pretrained(str(artifact.parent / "not-written"))


_IMPORT_AND_MEASURE = textwrap.dedent(
    """
    import json, sys
    import torch
    from diffusers import QwenImage21Transformer2DModel as Transformer

    try:
        Transformer.from_pretrained(sys.argv[1], subfolder="transformer")
        before = "loaded"
    except ValueError as error:
        before = str(error).splitlines()[0]
    import ditq.diffusers
    Transformer.from_pretrained(sys.argv[1], subfolder="transformer", torch_dtype=torch.bfloat16)  # warm-up
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # reset the kernel's peak (VmHWM) to the current resident size
    base = status("VmRSS")
    model = Transformer.from_pretrained(sys.argv[2], subfolder="transformer", torch_dtype=torch.bfloat16)
    for tensor in model.state_dict().values():  # every page of the (memory-mapped) file read: loaded means held
        tensor.reshape(-1).view(torch.uint8).max()
    layer = type(model.transformer_blocks[0].attn.to_q).__name__
    print(json.dumps({"before": before, "layer": layer, "added": status("VmHWM") - base}))
    """
)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").is_file(), reason="needs /proc's peak reset (Linux)")
def test_stock_diffusers_refuses_until_import_and_then_loads_without_a_source_precision_copy(
    demo_artifacts: dict[str, Path], tmp_path: Path
) -> None:
    """In a fresh interpreter: diffusers alone refuses the artifact; after ``import ditq.diffusers`` it loads a
    w8a8 transformer of 69 MiB within 1.2 times its bytes, every page read. Three quarters of it are int8 weights:
    a bfloat16 copy of them would add 1.5 times its bytes."""
    big = write_large_qwen_artifact(tmp_path / "big", 4, siblings_from=demo_artifacts["w8a8"])
    size = sum(p.stat().st_size for p in (big / "transformer").iterdir() if p.suffix == ".safetensors")
    assert size > 64 * 2**20  # large enough that the interpreter's noise does not matter
    measured = measure(_IMPORT_AND_MEASURE, str(demo_artifacts["w8a8"]), str(big))
    assert measured["before"].startswith("Unknown quantization type, got compressed-tensors")
    assert measured["layer"] == "W8A8Linear"
    assert 0.8 * size < measured["added"] <= 1.2 * size, measured["added"] / size


@pytest.fixture(scope="module")
def llmc_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("llmc-diffusers")
    return {fixture: llmc_pipeline_dir(root / fixture, fixture) for fixture in sorted(LLMC_SCHEMES)}


@pytest.mark.parametrize("fixture", sorted(LLMC_SCHEMES))
def test_llm_compressor_checkpoints_load_as_ditq_loads_them(llmc_dirs: dict[str, Path], fixture: str) -> None:
    """bfloat16 scales, groups of 16 (w8a16), llm-compressor's config fields: the same modules, tensors (scales
    read as float32 whatever torch_dtype says) and outputs as ditq's loader, in bfloat16 and in the pipeline."""
    model_dir = llmc_dirs[fixture]
    model = QwenImage21Transformer2DModel.from_pretrained(
        model_dir, subfolder="transformer", torch_dtype=torch.bfloat16
    )
    expected = load_component(model_dir, "transformer", device="cpu", dtype=torch.bfloat16)
    assert {layer.scheme.name for layer in quantized_linears(model).values()} == {LLMC_SCHEMES[fixture]}
    _same_tensors(model, expected)
    assert torch.equal(_forward(model, torch.bfloat16), _forward(expected, torch.bfloat16))
    pipeline = DiffusionPipeline.from_pretrained(model_dir)
    assert torch.equal(_image(pipeline), _image(load_pipeline(model_dir, device="cpu")))


def test_a_mixed_precision_artifact_loads_each_layer_in_its_scheme(
    mixed_artifact: tuple[Path, Path, Path],
) -> None:
    _, artifact, _ = mixed_artifact
    model = FluxTransformer2DModel.from_pretrained(artifact, subfolder="transformer")
    schemes = stored_layer_schemes(artifact, "transformer")
    assert {p: layer.scheme for p, layer in quantized_linears(model).items()} == schemes
    assert len({scheme.name for scheme in schemes.values()}) == 3
    expected = load_component(artifact, "transformer", device="cpu", dtype=torch.float32)
    with torch.no_grad():
        got = model(**example_inputs("flux", model))[0]
        want = expected(**example_inputs("flux", expected))[0]
    assert torch.equal(got, want)


def _transformer_copy(artifact: Path, folder: Path, edit_config: Any = None) -> Path:
    """``artifact``'s transformer folder alone under ``folder``, its config.json changed by ``edit_config``."""
    shutil.copytree(artifact / "transformer", folder / "transformer")
    config_path = folder / "transformer" / "config.json"
    config = json.loads(config_path.read_text())
    if edit_config is not None:
        edit_config(config["quantization_config"])
    config_path.write_text(json.dumps(config))
    return folder


def test_either_spelling_of_the_method_loads(demo_artifacts: dict[str, Path], tmp_path: Path) -> None:
    def underscore(qconfig: dict[str, Any]) -> None:
        qconfig["quant_method"] = "compressed_tensors"

    folder = _transformer_copy(demo_artifacts["fp8"], tmp_path, underscore)
    model = QwenImage21Transformer2DModel.from_pretrained(folder, subfolder="transformer")
    assert {layer.scheme.name for layer in quantized_linears(model).values()} == {"fp8"}


def test_a_scheme_ditq_does_not_read_is_one_line_naming_the_config(
    demo_artifacts: dict[str, Path], tmp_path: Path
) -> None:
    def four_bit(qconfig: dict[str, Any]) -> None:
        qconfig["config_groups"]["group_0"]["weights"]["num_bits"] = 4

    folder = _transformer_copy(demo_artifacts["w8a8"], tmp_path, four_bit)
    with pytest.raises(InputError) as error:
        QwenImage21Transformer2DModel.from_pretrained(folder, subfolder="transformer")
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"{folder / 'transformer'}/config.json: config group 'group_0' asks for 4-bit")


def test_a_missing_stored_tensor_is_one_line_naming_it(
    demo_artifacts: dict[str, Path], tmp_path: Path
) -> None:
    folder = _transformer_copy(demo_artifacts["w8a8"], tmp_path)
    tensors = load_file(str(folder / WEIGHTS))
    del tensors["proj_out.weight"]
    save_file(tensors, str(folder / WEIGHTS), metadata={"format": "pt"})
    index = folder / "transformer/diffusion_pytorch_model.safetensors.index.json"
    doc = json.loads(index.read_text())
    del doc["weight_map"]["proj_out.weight"]
    index.write_text(json.dumps(doc))
    with pytest.raises(InputError, match=r"tensor 'proj_out\.weight' is missing from the weight files"):
        QwenImage21Transformer2DModel.from_pretrained(folder, subfolder="transformer")


def test_quantizing_on_load_is_refused_in_one_line(demo_artifacts: dict[str, Path]) -> None:
    config = ditq.diffusers.CompressedTensorsConfig(
        json.loads((demo_artifacts["w8a8"] / "transformer/config.json").read_text())["quantization_config"]
    )
    with pytest.raises(
        InputError, match=r"loads quantized checkpoints; quantize a model with ditq\.quantize_"
    ):
        QwenImage21Transformer2DModel.from_pretrained(
            demo_artifacts["source"], subfolder="transformer", quantization_config=config
        )


def test_a_device_map_that_puts_weights_on_disk_is_refused(demo_artifacts: dict[str, Path]) -> None:
    with pytest.raises(
        InputError, match=r"^device_map: ditq's compressed-tensors backend keeps no weight on disk"
    ):
        QwenImage21Transformer2DModel.from_pretrained(
            demo_artifacts["w8a8"], subfolder="transformer", device_map={"": "disk"}
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("scheme", CUDA_SCHEMES)
def test_on_cuda_the_first_forward_repacks_and_draws_what_load_pipeline_draws(
    demo_artifacts: dict[str, Path], scheme: str
) -> None:
    pipeline = DiffusionPipeline.from_pretrained(demo_artifacts[scheme], torch_dtype=torch.bfloat16).to(
        "cuda"
    )
    layers = quantized_linears(pipeline.transformer)
    assert not any(layer.prepared for layer in layers.values())  # the repack waits for the run device
    got = _image(pipeline).cpu()
    assert all(layer.kernel is not None and layer.kernel.device_type == "cuda" for layer in layers.values())
    expected = load_pipeline(demo_artifacts[scheme], device="cuda", dtype=torch.bfloat16)
    assert torch.equal(got, _image(expected).cpu())


# Issue 48: every malformed quantization_config is one line naming the file before diffusers' own code sees it,
# as ditq.load_pipeline refuses it; and an artifact holding what its manifest does not list is refused too.


def _group_twice(qconfig: dict[str, Any]) -> dict[str, Any]:
    groups = qconfig["config_groups"]
    groups["group_1"] = json.loads(json.dumps(groups["group_0"]))
    return qconfig


MALFORMED = {
    "quant_method spelled Compressed-Tensors": (
        lambda q: {**q, "quant_method": "Compressed-Tensors"},
        "quant_method 'Compressed-Tensors': diffusers looks it up as written",
    ),
    "a list": (lambda q: [q], "quantization_config is a list, not an object"),
    "wrapped for another component": (
        lambda q: {"text_encoder": q},
        "has no quant_method (it holds text_encoder)",
    ),
    "wrapped for this one": (lambda q: {"transformer": q}, "diffusers reads the flat form only"),
    "quant_method a number": (lambda q: {**q, "quant_method": 7}, "quant_method is not a string"),
    "a config group given twice": (_group_twice, "config group 'group_1' repeats config group 'group_0'"),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_a_malformed_quantization_config_is_one_line_before_diffusers_reads_it(
    name: str, demo_artifacts: dict[str, Path], tmp_path: Path
) -> None:
    change, said = MALFORMED[name]
    folder = _transformer_copy(demo_artifacts["w8a8"], tmp_path)
    config_path = folder / "transformer" / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = change(config["quantization_config"])
    config_path.write_text(json.dumps(config))
    for load in (
        lambda: QwenImage21Transformer2DModel.from_pretrained(folder, subfolder="transformer"),
        lambda: QwenImage21Transformer2DModel.from_pretrained(folder / "transformer"),
    ):
        with pytest.raises(InputError) as error:
            load()
        message = str(error.value)
        assert message.startswith(f"{config_path}: ") and said in message and "\n" not in message, message


def test_a_config_group_given_twice_is_refused_by_the_loader_too() -> None:
    from ditq.checkpoint.codecs import config_groups
    from ditq.checkpoint.qconfig import quantization_config
    from ditq.schemes import get_scheme

    qconfig = _group_twice(quantization_config(get_scheme("w8a8"), ignore=[]))
    with pytest.raises(
        InputError, match=r"^t/config\.json: config group 'group_1' repeats config group 'group_0'"
    ):
        config_groups(qconfig, "t/config.json")


def test_diffusers_loads_only_what_the_manifest_lists(
    demo_artifacts: dict[str, Path], tmp_path: Path
) -> None:
    root = tmp_path / "demo"
    shutil.copytree(demo_artifacts["source"].parent, root, symlinks=True)  # the artifacts' links are relative
    artifact = root / "w8a8"
    stray = artifact / "transformer" / "extra.safetensors"
    stray.symlink_to(tmp_path / "elsewhere.json")
    for load in (
        lambda: DiffusionPipeline.from_pretrained(artifact),
        lambda: QwenImage21Transformer2DModel.from_pretrained(artifact, subfolder="transformer"),
    ):
        with pytest.raises(InputError, match=r"a link the manifest does not record.*ditq loads only what"):
            load()
