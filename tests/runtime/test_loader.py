"""Loading ditq artifacts: quantized forward vs the BF16 source, both config forms, clear errors when corrupt."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import TINY_CONFIGS, build_tiny, example_inputs, make_model_dir

import ditq
from ditq.checkpoint.qconfig import quantization_config
from ditq.errors import InputError
from ditq.numerics import relative_l2
from ditq.runtime.loader import load_component, prepare_quantized
from ditq.runtime.modules import QuantizedLinear, quantized_linear_class, quantized_linears
from ditq.schemes import get_scheme
from runtime.artifacts import target_linears, write_artifact

# Output of the whole tiny transformer vs the BF16 source model (loaded by diffusers), relative L2.
# Stored weights carry ~0.4 % (int8) / ~2.5 % (fp8 e4m3) error; per-token activations add about as much.
FORWARD_BOUND = {"w8a16": 0.02, "w8a8": 0.03, "w8a8-activations": 0.03, "fp8": 0.08}
SCHEMES = ("w8a16", "w8a8", "fp8")


def _forward(model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs)[0].float()


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sources")
    return {name: make_model_dir(root, name) for name in TINY_CONFIGS}


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_quantized_forward_matches_bf16_source(
    name: str, scheme: str, sources: dict[str, Path], tmp_path: Path
) -> None:
    source = sources[name]
    form = "wrapped" if scheme == "fp8" else "flat"  # both config forms, across the matrix
    ditq.quantize(source, tmp_path / "artifact", scheme, config_form=form)
    bf16 = load_component(source, "transformer", dtype=torch.bfloat16)

    quantized = load_component(tmp_path / "artifact", "transformer", dtype=torch.bfloat16)

    layers = quantized_linears(quantized)
    assert layers and all(type(layer) is quantized_linear_class(scheme) for layer in layers.values())
    plain_linears = {n for n, m in quantized.named_modules() if type(m) is torch.nn.Linear}
    ignore = set(quantized.ditq_quantization_config["ignore"])
    assert plain_linears <= ignore  # and every other module that stores a weight (norms, convolutions)
    others = {
        n
        for n, m in quantized.named_modules()
        if isinstance(getattr(m, "weight", None), torch.Tensor)
        and not isinstance(m, torch.nn.Linear | QuantizedLinear)
    }
    assert ignore - plain_linears == others
    # No source-precision weight behind a quantized layer.
    for layer in layers.values():
        assert not any(t.dtype == torch.bfloat16 and t.ndim == 2 for t in layer.buffers())
    inputs = example_inputs(name, build_tiny(name, dtype=torch.bfloat16))
    error = relative_l2(_forward(quantized, inputs), _forward(bf16, inputs))
    assert 0.0 < error < FORWARD_BOUND[scheme], f"{name} {scheme}: rel-L2 {error:.4f}"


def test_synthetic_artifact_targets_every_block_linear(sources: dict[str, Path], tmp_path: Path) -> None:
    model = build_tiny("wan", dtype=torch.bfloat16)
    artifact = write_artifact(sources["wan"], tmp_path / "artifact", model, "w8a8")
    assert sorted(quantized_linears(load_component(artifact, "transformer"))) == sorted(target_linears(model))


# A whole tiny text encoder against its BF16 source (random weights; e4m3 carries ~2.5 % per weight).
ENCODER_BOUND = {"w8a16": 0.03, "w8a8": 0.05, "fp8": 0.12}


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("encoder", ["t5", "clip"])
def test_quantized_transformers_text_encoder_runs(encoder: str, scheme: str, tmp_path: Path) -> None:
    source = make_model_dir(tmp_path, "flux", text_encoder=encoder)
    result = ditq.quantize(source, tmp_path / "artifact", scheme, components=("transformer", "text_encoder"))
    quantized = load_component(tmp_path / "artifact", "text_encoder", dtype=torch.bfloat16)
    reference = load_component(source, "text_encoder", dtype=torch.bfloat16)
    assert quantized_linears(quantized)
    ignored = result.manifest["components"]["text_encoder"]["ignored"]
    kept_for_their_weight = {n for n, reason in ignored.items() if reason.startswith("reads .weight")}
    if encoder == "t5":  # T5's feed-forward casts its input to self.wo.weight.dtype
        assert kept_for_their_weight == {f"encoder.block.{i}.layer.1.DenseReluDense.wo" for i in range(2)}
    else:
        assert not kept_for_their_weight
    ids = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        error = relative_l2(quantized(ids).last_hidden_state, reference(ids).last_hidden_state)
    assert 0.0 < error < ENCODER_BOUND[scheme], f"{encoder} {scheme}: rel-L2 {error:.4f}"


def test_wrapped_config_for_another_component_is_refused(sources: dict[str, Path], tmp_path: Path) -> None:
    artifact = write_artifact(
        sources["flux"], tmp_path / "a", build_tiny("flux", dtype=torch.bfloat16), "w8a8"
    )
    config_path = artifact / "transformer" / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = {"text_encoder": config["quantization_config"]}
    config_path.write_text(json.dumps(config))
    with pytest.raises(
        InputError, match=r"config\.json: quantization_config is for text_encoder, not for transformer"
    ):
        load_component(artifact, "transformer")


def test_both_spellings_of_the_method_load(sources: dict[str, Path], tmp_path: Path) -> None:
    artifact = write_artifact(
        sources["sd3"], tmp_path / "a", build_tiny("sd3", dtype=torch.bfloat16), "w8a16"
    )
    config_path = artifact / "transformer" / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"]["quant_method"] = "compressed_tensors"
    config_path.write_text(json.dumps(config))
    assert quantized_linears(load_component(artifact, "transformer"))


def test_kernel_repack_happens_once_and_releases_what_it_replaced(
    sources: dict[str, Path], tmp_path: Path
) -> None:
    model = build_tiny("qwenimage", dtype=torch.bfloat16)
    artifact = write_artifact(sources["qwenimage"], tmp_path / "a", model, "w8a16")
    quantized = load_component(artifact, "transformer")
    layer = next(iter(quantized_linears(quantized).values()))
    assert not layer.prepared and set(layer.stored_tensors()) == {
        "weight_packed",
        "weight_scale",
        "weight_shape",
    }
    inputs = example_inputs("qwenimage", quantized)
    first = _forward(quantized, inputs)
    assert layer.prepared and layer.kernel is not None
    prepared = layer.prepared_tensors()["weight"]
    assert torch.equal(_forward(quantized, inputs), first)
    assert layer.prepared_tensors()["weight"].data_ptr() == prepared.data_ptr()  # no second repack


# --- corrupted and incomplete artifacts --------------------------------------------------------------


@pytest.fixture
def w8a8_artifact(sources: dict[str, Path], tmp_path: Path) -> Path:
    model = build_tiny("qwenimage21", dtype=torch.bfloat16)
    return write_artifact(sources["qwenimage21"], tmp_path / "artifact", model, "w8a8", shard_bytes=20_000)


def _shards(artifact: Path) -> list[Path]:
    return sorted((artifact / "transformer").glob("*.safetensors"))


def _rewrite_shard_holding(artifact: Path, tensor: str, change: Any) -> Path:
    for shard in _shards(artifact):
        tensors = load_file(str(shard))
        if tensor in tensors:
            change(tensors)
            save_file(tensors, str(shard))
            return shard
    raise AssertionError(f"no shard holds {tensor}")


def test_truncated_shard_names_the_file(w8a8_artifact: Path) -> None:
    shard = _shards(w8a8_artifact)[-1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    with pytest.raises(InputError, match=rf"{shard.name}: tensor '.+' runs past the end of the file"):
        load_component(w8a8_artifact, "transformer")


def test_garbage_header_names_the_file(w8a8_artifact: Path) -> None:
    shard = _shards(w8a8_artifact)[0]
    shard.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all" + b"\x00" * 64)
    with pytest.raises(InputError, match=rf"{shard.name}: corrupt safetensors header"):
        load_component(w8a8_artifact, "transformer")


@pytest.mark.parametrize(
    ("header", "reason"),
    [
        (b"[" * 5000 + b"]" * 5000, "nested more than 64 deep"),
        (b'{"a": {"dtype": "F32", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 4]}}', "5000 digits"),
        (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "a": {}}', "key 'a' given twice"),
    ],
    ids=["deep", "5000-digit integer", "duplicate tensor"],
)
def test_a_hostile_header_is_one_line_naming_the_file(
    w8a8_artifact: Path, header: bytes, reason: str
) -> None:
    """The header is JSON too, read by the same bounded reader (a deep one was a RecursionError)."""
    shard = _shards(w8a8_artifact)[0]
    shard.write_bytes(len(header).to_bytes(8, "little") + header + b"\x00" * 4)
    with pytest.raises(InputError, match=rf"{shard.name}: corrupt safetensors header \(.*{reason}"):
        load_component(w8a8_artifact, "transformer")


def test_missing_tensor_is_named(w8a8_artifact: Path) -> None:
    name = "transformer_blocks.1.attn.norm_k.weight"
    _rewrite_shard_holding(w8a8_artifact, name, lambda tensors: tensors.pop(name))
    with pytest.raises(InputError, match=rf"tensor '{name}' is missing from the weight files"):
        load_component(w8a8_artifact, "transformer")


def test_missing_scale_of_a_targeted_layer_is_named(w8a8_artifact: Path) -> None:
    name = "transformer_blocks.0.attn.to_v.weight_scale"
    _rewrite_shard_holding(w8a8_artifact, name, lambda tensors: tensors.pop(name))
    with pytest.raises(InputError, match=r"transformer_blocks\.0\.attn\.to_v"):
        load_component(w8a8_artifact, "transformer")


def test_wrong_stored_dtype_is_named(w8a8_artifact: Path) -> None:
    name = "transformer_blocks.0.attn.to_q.weight"

    def widen(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = tensors[name].to(torch.int16)

    _rewrite_shard_holding(w8a8_artifact, name, widen)
    with pytest.raises(
        InputError, match=r"transformer_blocks\.0\.attn\.to_q\.weight_scale has no int8/fp8 weight"
    ):
        load_component(w8a8_artifact, "transformer")


def test_wrong_shape_is_named(w8a8_artifact: Path) -> None:
    name = "transformer_blocks.0.attn.to_q.weight_scale"

    def reshape(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = tensors[name][:-1].clone()

    _rewrite_shard_holding(w8a8_artifact, name, reshape)
    with pytest.raises(InputError, match=rf"tensor '{name}' has shape"):
        load_component(w8a8_artifact, "transformer")


def test_format_that_contradicts_the_tensors_is_named(w8a8_artifact: Path) -> None:
    config_path = w8a8_artifact / "transformer" / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = quantization_config(
        get_scheme("fp8"), config["quantization_config"]["ignore"]
    )
    config_path.write_text(json.dumps(config))
    with pytest.raises(
        InputError,
        match=r"config\.json: transformer_blocks\.0\.\S+: quantization_config says float-quantized, but the "
        r"tensors are int-quantized$",
    ):
        load_component(w8a8_artifact, "transformer")


def test_stray_tensor_is_named(w8a8_artifact: Path) -> None:
    name = "transformer_blocks.0.attn.to_q.weight"
    _rewrite_shard_holding(w8a8_artifact, name, lambda t: t.update({"not_a_module.weight": torch.zeros(2)}))
    with pytest.raises(
        InputError, match=r"tensor 'not_a_module\.weight' has no place in QwenImage21Transformer2DModel"
    ):
        load_component(w8a8_artifact, "transformer")


def test_float64_scales_are_refused_as_verify_refuses_them(w8a8_artifact: Path) -> None:
    name = "transformer_blocks.0.attn.to_q.weight_scale"
    _rewrite_shard_holding(w8a8_artifact, name, lambda t: t.update({name: t[name].double()}))
    with pytest.raises(InputError, match=rf"{name} is torch.float64; scales are float32, bfloat16, float16$"):
        load_component(w8a8_artifact, "transformer")


def test_unknown_component_is_named(w8a8_artifact: Path) -> None:
    with pytest.raises(InputError, match=r"no component 'vae'"):
        load_component(w8a8_artifact, "vae")


def test_quantized_linear_class_per_scheme() -> None:
    assert {quantized_linear_class(s).scheme.name for s in SCHEMES} == set(SCHEMES)
    assert issubclass(quantized_linear_class("fp8"), QuantizedLinear)
    with pytest.raises(InputError, match="no quantized Linear for scheme 'int4'"):
        quantized_linear_class("int4")


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantized_blocks_compile_without_graph_breaks(
    scheme: str, sources: dict[str, Path], tmp_path: Path
) -> None:
    ditq.quantize(sources["qwenimage21"], tmp_path / "artifact", scheme)
    quantized = load_component(tmp_path / "artifact", "transformer", dtype=torch.bfloat16)
    prepare_quantized(quantized, "cpu", torch.bfloat16)
    inputs = example_inputs("qwenimage21", build_tiny("qwenimage21", dtype=torch.bfloat16))
    eager = _forward(quantized, inputs)
    torch._dynamo.reset()
    quantized.compile_repeated_blocks(fullgraph=True, backend="aot_eager")  # a graph break raises
    assert torch.equal(_forward(quantized, inputs), eager)


def test_int_quantized_without_input_activations_runs_weight_only(
    sources: dict[str, Path], tmp_path: Path
) -> None:
    model = build_tiny("flux", dtype=torch.bfloat16)
    stored_unpacked = write_artifact(sources["flux"], tmp_path / "unpacked", model, "w8a8")
    packed = write_artifact(
        sources["flux"], tmp_path / "packed", model, "w8a16"
    )  # same int8 values and scales
    w8a8 = load_component(stored_unpacked, "transformer", dtype=torch.bfloat16)
    config_path = stored_unpacked / "transformer" / "config.json"
    config = json.loads(config_path.read_text())
    for group in config["quantization_config"]["config_groups"].values():
        del group["input_activations"]  # the config asks for int8 weights only
    config_path.write_text(json.dumps(config))

    weight_only = load_component(stored_unpacked, "transformer", dtype=torch.bfloat16)

    layers = quantized_linears(weight_only).values()
    assert layers and {(type(layer), layer.scheme.format) for layer in layers} == {
        (quantized_linear_class("w8a16"), "int-quantized")
    }
    inputs = example_inputs("flux", model)
    output = _forward(weight_only, inputs)
    assert torch.equal(output, _forward(load_component(packed, "transformer", dtype=torch.bfloat16), inputs))
    assert relative_l2(output, _forward(w8a8, inputs)) > 1e-3  # activations were quantized before


def test_transform_config_is_refused_by_name(w8a8_artifact: Path) -> None:
    config_path = w8a8_artifact / "transformer" / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"]["transform_config"] = {"config_groups": {"u": {"type": "hadamard"}}}
    config_path.write_text(json.dumps(config))
    with pytest.raises(InputError, match=r"^\S+/transformer/config\.json: transform_config is not empty"):
        load_component(w8a8_artifact, "transformer")


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (float("nan"), "weight_scale holds 1 NaN or Inf value"),
        (float("inf"), "weight_scale holds 1 NaN or Inf value"),
        (3e38, "weight_scale 3e+38 is out of range: 127 times it overflows float32"),
        (-0.01, "weight_scale holds negative values"),
        (0.0, "weight_scale holds zero values"),
    ],
    ids=["nan", "inf", "3e38", "negative", "zero"],
)
def test_a_scale_that_cannot_scale_is_refused_naming_file_and_tensor(
    w8a8_artifact: Path, value: float, problem: str
) -> None:
    """Issue 28, item 8: these loaded, and ditq generate wrote a transparent or wrong image with exit 0. The check
    is verify's (``Codec.scale_problem``)."""
    name = "transformer_blocks.1.attn.to_k.weight_scale"

    def spoil(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name][1, 0] = value

    shard = _rewrite_shard_holding(w8a8_artifact, name, spoil)
    with pytest.raises(InputError, match=rf"^{shard}: tensor '{name}': {re.escape(problem)}"):
        load_component(w8a8_artifact, "transformer", device="cpu")


@pytest.mark.parametrize("how", ["null", "missing"])
def test_quantized_weights_without_a_quantization_config_are_refused(w8a8_artifact: Path, how: str) -> None:
    """Issue 28, item 8: with ``quantization_config: null`` the int8 weights loaded as floats."""
    config_path = w8a8_artifact / "transformer" / "config.json"
    config = json.loads(config_path.read_text())
    if how == "null":
        config["quantization_config"] = None
    else:
        del config["quantization_config"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(
        InputError,
        match=rf"^{config_path}: no compressed-tensors quantization_config, but \S+ holds the quantized",
    ):
        load_component(w8a8_artifact, "transformer", device="cpu")


@pytest.mark.parametrize(
    "group_size",
    ["abc", None, 0, True, 1.5, "128"],
    ids=["text", "missing", "zero", "boolean", "fraction", "number-as-text"],
)
def test_group_strategy_needs_a_positive_integer_group_size(w8a8_artifact: Path, group_size: Any) -> None:
    """Issue 28, item 13: ``group_size: "abc"`` was a ValueError traceback; a missing one was read as per channel
    by the loader while compressed-tensors (and so verify) refused it."""
    config_path = w8a8_artifact / "transformer" / "config.json"
    config = json.loads(config_path.read_text())
    (group,) = config["quantization_config"]["config_groups"].values()
    group["weights"].update(strategy="group", group_size=group_size)
    if group_size is None:
        del group["weights"]["group_size"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(
        InputError, match=r"config group 'group_0': .*group_size that is a positive integer, got"
    ):
        load_component(w8a8_artifact, "transformer", device="cpu")


def test_an_unknown_quantization_method_names_the_config(w8a8_artifact: Path) -> None:
    config_path = w8a8_artifact / "transformer" / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"]["quant_method"] = 5
    config_path.write_text(json.dumps(config))
    with pytest.raises(
        InputError, match=r"^transformer/config.json: quantization_config: unsupported quantization"
    ):
        load_component(w8a8_artifact, "transformer", device="cpu")


@pytest.mark.parametrize(
    "entry",
    ["diffusers", ["transformers", "AutoModel"]],
    ids=["a bare string", "a class without from_pretrained"],
)
def test_a_model_index_entry_diffusers_cannot_build_is_one_line(tmp_path: Path, entry: Any) -> None:
    """The attack rerun: these gave a ValueError traceback from diffusers' pipeline loading in ditq generate."""
    import shutil

    from ditq.demo import default_model_dir

    model = tmp_path / "model"
    shutil.copytree(default_model_dir(), model)
    index = json.loads((model / "model_index.json").read_text())
    index["scheduler"] = entry
    (model / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(InputError, match=r"model_index\.json: ") as info:
        ditq.load_pipeline(model, device="cpu")
    assert "\n" not in str(info.value)
