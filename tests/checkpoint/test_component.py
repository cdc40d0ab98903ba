"""One safe way to build a component: trusted classes only, no code from the model, declared sizes against the
stored tensors before anything real is allocated, strict safetensors headers and model_index.json entries."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import ditq
from ditq.checkpoint.component import build_on_meta, import_class, refuse_remote_code
from ditq.checkpoint.layout import read_json, read_model_index
from ditq.checkpoint.safetensors_io import read_header
from ditq.demo import default_model_dir
from ditq.errors import InputError
from ditq.pipeline.open import load_pipeline
from ditq.runtime.loader import component_entries, load_component


@pytest.fixture
def demo_copy(tmp_path: Path) -> Callable[..., Path]:
    """Factory: a copy of the bundled demo model, with ``component``'s config.json updated by ``fields``."""

    def make(component: str = "transformer", **fields: Any) -> Path:
        folder = tmp_path / f"demo-{len(list(tmp_path.glob('demo-*')))}"
        shutil.copytree(default_model_dir(), folder)
        _update(folder / component / "config.json", **fields)
        return folder

    return make


def _update(path: Path, **fields: Any) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def _build(component_dir: Path, exact: bool = False) -> torch.nn.Module:
    library, class_name = read_json(component_dir.parent / "model_index.json")[component_dir.name]
    cls = import_class(library, class_name, "test")
    entries = component_entries(component_dir, None)
    return build_on_meta(cls, read_json(component_dir / "config.json"), component_dir, entries, exact)


@pytest.mark.parametrize(
    ("library", "class_name", "message"),
    [
        ("evilcode", "EvilModel", "class evilcode.EvilModel is not from diffusers, transformers, ditq.demo"),
        ("os", "system", "class os.system is not from"),
        ("ditq.runtime", "loader", "class ditq.runtime.loader is not from"),
        ("diffusers", "logging", "diffusers.logging is not a class"),
        ("diffusers", "__class__", "'__class__' is not a class name"),
        ("diffusers/../x", "Model", "is not from"),
    ],
)
def test_only_trusted_classes_are_imported(library: str, class_name: str, message: str) -> None:
    with pytest.raises(InputError, match=message):
        import_class(library, class_name, "model_index.json: transformer")
    assert import_class("ditq.demo.text_encoder", "DemoTextEncoder", "here").__name__ == "DemoTextEncoder"


def test_code_shipped_with_a_component_is_refused(tmp_path: Path) -> None:
    component = tmp_path / "text_encoder"
    component.mkdir()
    (component / "config.json").write_text(json.dumps({"model_type": "t5"}))
    refuse_remote_code(component, "transformers")
    (component / "tokenizer_config.json").write_text(
        json.dumps({"auto_map": {"AutoTokenizer": ["evil.Tok", None]}})
    )
    with pytest.raises(InputError, match=r"tokenizer_config.json: auto_map asks for the model's own code"):
        refuse_remote_code(component, "transformers")
    (component / "tokenizer_config.json").unlink()
    (component / "diffusers.py").write_text("raise SystemExit('ran')\n")
    with pytest.raises(
        InputError, match=r"diffusers.py: a module shipped with the model in place of diffusers"
    ):
        refuse_remote_code(component, "diffusers")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"num_layers": 200000},
            r"config.json: declares more than \d+ parameter tensors, its weight files hold \d+ tensors",
        ),
        (
            {"num_layers": 7},
            r"config.json: tensor 'transformer_blocks.6.\S+' is missing from the weight files",
        ),
        (
            {"num_attention_heads": 2**20},
            r"safetensors: tensor '\S+' has shape \[256, 256\], .* declares \[67108864",
        ),
        (
            {"axes_dims_rope": [16777216, 24, 24]},
            r"config.json: axes_dims_rope \[16777216, 24, 24\] adds up to",
        ),
        ({"mlp_ratio": 300}, r"has shape \[768, 256\], .*config.json declares \[76800, 256\]"),
        ({"num_layers": "six"}, r"config.json: cannot build a QwenImage21Transformer2DModel from it"),
        ({"num_attention_heads": -4}, r"config.json: num_attention_heads is -4; a count is never negative"),
        (  # JSON's Infinity, which Python's reader takes, in a list
            {"axes_dims_rope": [8, float("inf"), 12]},
            r"config.json: axes_dims_rope is \[8, inf, 12\]; a config's numbers are finite",
        ),
        (
            {"extra_grid": [[1.0], [float("nan")]]},
            r"config.json: extra_grid is \[\[1.0\], \[nan\]\]; a config's",
        ),
        (  # an object inside a list: named by its index
            {"extra_stages": [{"eps": 1e-6}, {"eps": float("nan")}]},
            r"config.json: extra_stages\[1\].eps is nan; a config's numbers are finite",
        ),
        (
            {"extra_stages": [[{"num_heads": -1}]]},
            r"config.json: extra_stages\[0\]\[0\].num_heads is -1; a count",
        ),
    ],
)
def test_declared_sizes_beyond_the_files_are_refused_before_building(
    fields: dict[str, Any], message: str, demo_copy
) -> None:  # type: ignore[no-untyped-def]
    model = demo_copy(**fields)
    with pytest.raises(InputError, match=message) as refused:
        _build(model / "transformer")
    assert "\n" not in str(refused.value)
    with pytest.raises(InputError, match=message):  # diffusers never sees it
        load_pipeline(model, device="cpu")


def test_tables_built_beyond_the_files_are_refused(model_dir) -> None:  # type: ignore[no-untyped-def]
    """Tensors a build makes that no file stores (Wan's rotary tables, rope_max_seq_len positions long): bounded
    before the real build allocates them."""
    source = model_dir("wan")
    assert all(p.is_meta for p in _build(source / "transformer").parameters())
    _update(source / "transformer" / "config.json", rope_max_seq_len=2**26)
    with pytest.raises(InputError, match=r"would allocate \d+ bytes of tensors its weight files do not hold"):
        _build(source / "transformer")


def test_text_encoder_layers_cloned_by_deepcopy_are_counted(demo_copy) -> None:  # type: ignore[no-untyped-def]
    """torch's TransformerEncoder deep-copies its layer: no register_parameter call, counted all the same."""
    model = demo_copy("text_encoder", num_layers=100000)
    with pytest.raises(InputError, match=r"text_encoder/config.json: declares more than"):
        load_pipeline(model, device="cpu")


def test_stored_tensors_must_have_their_place_when_exact(model_dir) -> None:  # type: ignore[no-untyped-def]
    source = model_dir("flux")
    weights = source / "transformer" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(str(weights))
    save_file({**tensors, "stray.weight": torch.zeros(2)}, str(weights))
    _build(source / "transformer")  # diffusers ignores what it has no place for
    with pytest.raises(InputError, match=r"tensor 'stray.weight' has no place in FluxTransformer2DModel"):
        _build(source / "transformer", exact=True)
    tensors["norm_out.linear.bias"] = torch.zeros(7)
    save_file(tensors, str(weights))
    with pytest.raises(InputError, match=r"tensor 'norm_out.linear.bias' has shape \[7\], .*declares \[64\]"):
        _build(source / "transformer")


def test_a_tensor_in_two_shards_is_refused(model_dir) -> None:  # type: ignore[no-untyped-def]
    source = model_dir("flux", shards=2)
    first, second = sorted((source / "transformer").glob("*.safetensors"))
    tensors = load_file(str(second))
    save_file({**tensors, **dict(list(load_file(str(first)).items())[:1])}, str(second))
    with pytest.raises(InputError, match=rf"{second.name}: tensor \S+ also in {first.name}"):
        component_entries(source / "transformer", None)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (
            {"../outside": ["diffusers", "FluxTransformer2DModel"]},
            "component name '../outside' is not a plain name",
        ),
        (
            {"sub/dir": ["diffusers", "FluxTransformer2DModel"]},
            "component name 'sub/dir' is not a plain name",
        ),
        (
            {"transformer": ["diffusers", "FluxTransformer2DModel", "x"]},
            r"transformer: \[.*\] is not \[library, class\]",
        ),
        (
            {"transformer": ["diffusers", None]},
            r"transformer: \['diffusers', None\] is not \[library, class\]",
        ),
    ],
)
def test_model_index_entries_are_plain_pairs(entry: dict[str, Any], message: str, model_dir) -> None:  # type: ignore[no-untyped-def]
    source = model_dir("flux")
    _update(source / "model_index.json", **entry)
    with pytest.raises(InputError, match=message):
        read_model_index(source)
    _update(source / "model_index.json", **{k: None for k in entry})
    _update(source / "model_index.json", transformer=["diffusers", "FluxTransformer2DModel"], pair=[1, 2, 3])
    assert read_model_index(source)["pair"] == [1, 2, 3]  # a pipeline setting, not a component


def _header_file(path: Path, header: dict[str, Any], data: bytes) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        (
            {"a": {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}},
            r"shape \[2.0\] is not a list of whole",
        ),
        (
            {"a": {"dtype": "F32", "shape": [True, 2], "data_offsets": [0, 8]}},
            "is not a list of whole numbers",
        ),
        ({"a": {"dtype": "F32", "shape": ["2"], "data_offsets": [0, 8]}}, "is not a list of whole numbers"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0.0, 8]}}, r"data_offsets \[0.0, 8\] is not"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8, 9]}}, "is not \\[begin, end\\]"),
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            "tensors 'a' and 'b' overlap",
        ),
        ({"a": ["F32"]}, "malformed header entry"),
    ],
)
def test_safetensors_headers_are_strict(entries: dict[str, Any], message: str, tmp_path: Path) -> None:
    with pytest.raises(InputError, match=message):
        read_header(_header_file(tmp_path / "x.safetensors", entries, bytes(16)))


def test_crafted_artifact_components_fail_verify_as_the_loader_refuses_them(artifact) -> None:  # type: ignore[no-untyped-def]
    """Verify says what the loader says: a kept tensor of the wrong shape, an unknown tensor, an extra
    input_scale, a header with a float shape (each on a copy without a manifest, so no digest hides it)."""
    _, out = artifact("flux", "w8a8")
    (out / "MANIFEST.json").unlink()
    weights = out / "transformer" / "diffusion_pytorch_model.safetensors"
    genuine = load_file(str(weights))
    edits = {
        "norm_out.linear.bias": lambda t: t.update({"norm_out.linear.bias": torch.zeros(7)}),
        "stray.weight": lambda t: t.update({"stray.weight": torch.zeros(2)}),
        "input_scale": lambda t: t.update({"transformer_blocks.0.attn.to_q.input_scale": torch.ones(1)}),
    }
    for needle, edit in edits.items():
        tensors = dict(genuine)
        edit(tensors)
        save_file(tensors, str(weights))
        failed = {c.name: c.detail for c in ditq.verify(out).checks if not c.ok}
        assert needle in failed["transformer: tensors"], failed
        with pytest.raises(InputError, match=needle):
            load_component(out, "transformer", "cpu")
    save_file(genuine, str(weights))
    assert ditq.verify(out).ok
    data = weights.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    header["norm_out.linear.bias"]["shape"] = [float(d) for d in header["norm_out.linear.bias"]["shape"]]
    raw = json.dumps(header).encode()  # offsets count from the header's end: its length may change
    weights.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + size :])
    failed = {c.name: c.detail for c in ditq.verify(out).checks if not c.ok}
    assert "is not a list of whole numbers" in failed["transformer: tensors"]


def test_verify_checks_the_unquantized_components_as_the_loader_does(artifact) -> None:  # type: ignore[no-untyped-def]
    """A text encoder left in source precision, whose config declares layers its files do not hold: the loader
    refuses it before diffusers builds it, and so does verify (here without a manifest whose digests would)."""
    _, out = artifact("flux", "w8a8", text_encoder=True, components="transformer", copy=True)
    (out / "MANIFEST.json").unlink()
    assert ditq.verify(out).ok
    _update(out / "text_encoder" / "config.json", num_layers=100000)
    failed = {c.name: c.detail for c in ditq.verify(out).checks if not c.ok}
    assert list(failed) == ["model_index"]
    assert "text_encoder/config.json: declares more than" in failed["model_index"]
