"""The streaming quantizer: artifact layout, fidelity of a forward pass, determinism, and every bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from diffusers import QwenImage21Transformer2DModel
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tiny_models import TINY_CONFIGS, build_tiny, example_inputs, write_model_dir

import ditq
import ditq.quantization.rewrite as rewrite
from ditq.checkpoint.codecs import codec_for, quantized_layers, scheme_of_config
from ditq.checkpoint.layout import quantization_config_of
from ditq.checkpoint.manifest import read_manifest
from ditq.checkpoint.safetensors_io import ShardSetWriter
from ditq.errors import DitqError, InputError
from ditq.numerics import relative_l2

SCHEMES = ["w8a16", "w8a8", "fp8"]
# Forward-pass relative L2 of a dequantized model vs BF16, per scheme (weights only; activations untouched).
FORWARD_BOUND = {"w8a16": 0.03, "w8a8": 0.03, "fp8": 0.08}


def _tensors(component: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(component.glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


def _dequantized_state(component: Path) -> dict[str, torch.Tensor]:
    """The artifact's component as a plain BF16 state dict (quantized Linears decoded by ditq)."""
    config = json.loads((component / "config.json").read_text())
    codec = codec_for(scheme_of_config(quantization_config_of(config, component.name) or {}, "test"))
    tensors = _tensors(component)
    layers = quantized_layers(tensors)
    stored = {p: {n: tensors.pop(f"{p}.{n}") for n in names} for p, names in layers.items()}
    return tensors | {f"{p}.weight": codec.decode(s, torch.bfloat16) for p, s in stored.items()}


def _tree_bytes(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file()
        and not p.is_symlink()
        and not any(q.is_symlink() for q in p.relative_to(root).parents if q != Path("."))
    }


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_forward_pass_close_to_bf16(name: str, scheme: str, artifact) -> None:  # type: ignore[no-untyped-def]
    _, out = artifact(name, scheme)
    reference = build_tiny(name, dtype=torch.bfloat16)
    quantized = build_tiny(name, dtype=torch.bfloat16)
    quantized.load_state_dict(_dequantized_state(out / "transformer"), strict=True)
    inputs = example_inputs(name, reference)
    with torch.no_grad():
        expected = reference(**inputs)[0].float()
        actual = quantized(**inputs)[0].float()
    error = relative_l2(actual, expected)
    assert 0 < error < FORWARD_BOUND[scheme], f"{name} {scheme}: forward rel-L2 {error:.4f}"


@pytest.mark.parametrize("scheme", SCHEMES)
def test_artifact_layout(scheme: str, artifact) -> None:  # type: ignore[no-untyped-def]
    source, out = artifact("wan", scheme, shards=2)
    assert (out / "model_index.json").read_bytes() == (source / "model_index.json").read_bytes()
    assert (out / "scheduler").is_symlink() and (out / "scheduler").resolve() == (
        source / "scheduler"
    ).resolve()
    config = json.loads((out / "transformer" / "config.json").read_text())
    plain = config["quantization_config"]  # flat, the default
    assert (
        plain["format"]
        == {"w8a16": "pack-quantized", "w8a8": "int-quantized", "fp8": "float-quantized"}[scheme]
    )
    assert "blocks.0.ffn.net.0.proj" in plain["ignore"] and "proj_out" in plain["ignore"]
    tensors = _tensors(out / "transformer")
    source_tensors = _tensors(source / "transformer")
    prefix = "blocks.0.attn1.to_q"
    if scheme == "w8a16":
        assert tensors[f"{prefix}.weight_packed"].dtype == torch.int32
        assert tensors[f"{prefix}.weight_packed"].shape == (32, 8)
        assert tensors[f"{prefix}.weight_shape"].tolist() == [32, 32]
    else:
        assert tensors[f"{prefix}.weight"].dtype == (torch.int8 if scheme == "w8a8" else torch.float8_e4m3fn)
    assert tensors[f"{prefix}.weight_scale"].dtype == torch.float32
    assert tensors[f"{prefix}.weight_scale"].shape == (32, 1)
    assert torch.equal(tensors[f"{prefix}.bias"], source_tensors[f"{prefix}.bias"])
    for name in ("proj_out.weight", "blocks.0.ffn.net.2.weight", "scale_shift_table"):
        assert torch.equal(tensors[name], source_tensors[name]) and tensors[name].dtype == torch.bfloat16


def test_manifest_contents(artifact) -> None:  # type: ignore[no-untyped-def]
    source, out = artifact("flux", "w8a8", shards=2)
    manifest = read_manifest(out)
    assert manifest["inputs"]["source"] == str(source.resolve())
    assert manifest["inputs"]["tree_digest"].startswith("sha256:") and manifest["inputs"]["files"] == 6
    assert {"torch", "diffusers", "compressed-tensors", "safetensors", "ditq"} <= set(manifest["versions"])
    info = manifest["components"]["transformer"]
    assert info["class"] == ["diffusers", "FluxTransformer2DModel"]
    assert info["ignored"]["x_embedder"].startswith("boundary")
    assert (
        info["quantization_config"]
        == json.loads((out / "transformer/config.json").read_text())["quantization_config"]
    )
    stats = manifest["statistics"]
    modules = dict(build_tiny("flux").named_modules())
    assert stats["quantized_tensors"] == len(info["quantized"]) == 22
    assert stats["quantized_params"] == sum(modules[p].weight.numel() for p in info["quantized"])
    total = sum(t.numel() for t in build_tiny("flux").state_dict().values())
    assert stats["quantized_params"] + stats["kept_params"] == total
    assert 0 < stats["mean_rel_l2"] <= stats["max_rel_l2"] < 0.05
    errors = json.loads((out / manifest["errors_file"]).read_text())["tensors"]
    assert len(errors) == 22 and max(errors.values()) == stats["max_rel_l2"]
    for rel, record in manifest["files"].items():
        assert (out / rel).stat().st_size == record["size"]
    assert set(manifest["files"]) == {
        "model_index.json",
        "tensor_errors.json",
        "transformer/config.json",
        "transformer/diffusion_pytorch_model.safetensors",
        "transformer/diffusion_pytorch_model.safetensors.index.json",  # for compressed-tensors' file tools
    }
    assert manifest["linked"] == {
        "scheduler": f"../{source.parent.name}/{source.name}/scheduler"
    }  # beside it
    assert sorted(manifest["source_files"]) == sorted(
        p.relative_to(source).as_posix() for p in source.rglob("*") if p.is_file()
    )
    assert manifest["source_files"]["model_index.json"] == manifest["files"]["model_index.json"]


def test_deterministic_and_band_size_independent(model_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    source = model_dir("qwenimage", shards=2)
    ditq.quantize(source, tmp_path / "a", "w8a16")
    ditq.quantize(source, tmp_path / "b", "w8a16")
    ditq.quantize(source, tmp_path / "c", "w8a16", band_bytes=200)  # a few rows per band
    first = _tree_bytes(tmp_path / "a")
    assert len(first) == 7
    assert first == _tree_bytes(tmp_path / "b")
    banded = _tree_bytes(tmp_path / "c")  # error sums differ in the last bits; the tensors must not
    assert {k: v for k, v in first.items() if k.startswith("transformer/")} == {
        k: v for k, v in banded.items() if k.startswith("transformer/")
    }


def test_output_shards_and_index(model_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    source = model_dir("sd3")
    ditq.quantize(source, tmp_path / "one", "fp8")
    ditq.quantize(source, tmp_path / "many", "fp8", max_shard_bytes=40_000)
    shards = sorted((tmp_path / "many/transformer").glob("*.safetensors"))
    assert len(shards) > 1 and shards[0].name.startswith("diffusion_pytorch_model-00001-of-")
    index_path = tmp_path / "many/transformer/diffusion_pytorch_model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    whole = _tensors(tmp_path / "one/transformer")
    assert set(index["weight_map"]) == set(whole)
    for name, file_name in index["weight_map"].items():
        with safe_open(str(tmp_path / "many/transformer" / file_name), "pt") as handle:
            assert torch.equal(handle.get_tensor(name).view(torch.uint8), whole[name].view(torch.uint8))


def test_copy_config_form_and_text_encoder(model_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    source = model_dir("flux", text_encoder=True)
    out = tmp_path / "out"
    ditq.quantize(
        source, out, "w8a8", components=["transformer", "text_encoder"], config_form="wrapped", copy=True
    )
    assert (out / "scheduler").is_dir() and not (out / "scheduler").is_symlink()
    assert "scheduler/scheduler_config.json" in read_manifest(out)["files"]
    for component in ("transformer", "text_encoder"):
        config = json.loads((out / component / "config.json").read_text())
        assert config["quantization_config"][component]["quant_method"] == "compressed-tensors"  # wrapped
    encoder = _tensors(out / "text_encoder")
    assert encoder["encoder.block.0.layer.0.SelfAttention.q.weight"].dtype == torch.int8
    assert encoder["shared.weight"].dtype == torch.bfloat16


def test_force_replaces_and_refuses_without(artifact, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    source, out = artifact("wan", "w8a8")
    with pytest.raises(InputError, match="already exists"):
        ditq.quantize(source, out, "fp8")
    ditq.quantize(source, out, "fp8", force=True)
    assert read_manifest(out)["scheme"]["name"] == "fp8"
    assert [p.name for p in tmp_path.iterdir() if ".ditq-tmp-" in p.name] == []


def _corrupt(source: Path, how: str) -> None:
    transformer = source / "transformer"
    shard = sorted(transformer.glob("*.safetensors"))[0]
    if how == "truncated":
        shard.write_bytes(shard.read_bytes()[:-100])
    elif how == "header":
        data = bytearray(shard.read_bytes())
        data[10:20] = b"\xff" * 10
        shard.write_bytes(bytes(data))
    elif how == "missing shard":
        shard.unlink()
    elif how in ("nan", "dtype", "quantized"):
        tensors = load_file(str(shard))
        name = next(n for n in sorted(tensors) if n.endswith("attn.to_q.weight"))
        if how == "nan":
            tensors[name][0, 0] = float("nan")
        elif how == "dtype":
            tensors[name] = tensors[name].double()
        else:
            tensors[name.replace(".weight", ".weight_scale")] = torch.ones(1)
        save_file(tensors, str(shard))
    elif how == "no index":
        (source / "model_index.json").unlink()
    elif how == "no folder":
        shutil.rmtree(source / "scheduler")
    elif how == "no component":
        index = json.loads((source / "model_index.json").read_text())
        del index["transformer"]
        (source / "model_index.json").write_text(json.dumps(index))


BAD_INPUTS = {
    "truncated": r"truncated",
    "header": r"safetensors",
    "missing shard": r"shard named by .* is missing",
    "nan": r"^\S+/transformer/\S+\.safetensors: tensor \S+to_q.weight holds NaN or Inf",  # the file, not a descriptor
    "dtype": r"to_q.weight has unsupported dtype torch.float64",
    "quantized": r"already quantized",
    "no index": r"not a diffusers model directory",
    "no component": r"no component 'transformer'",
    "no folder": r"model_index.json: component 'scheduler' \(diffusers.FlowMatchEulerDiscreteScheduler\) has no folder .*/scheduler$",
}


@pytest.mark.parametrize("how", sorted(BAD_INPUTS))
def test_bad_input_is_a_one_line_input_error(how: str, model_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    source = model_dir("flux", shards=2)
    _corrupt(source, how)
    with pytest.raises(InputError, match=BAD_INPUTS[how]) as info:
        ditq.quantize(source, tmp_path / "out", "w8a8", components=["transformer"])
    assert "\n" not in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == [source.parent.name]


def test_requantizing_an_artifact_is_refused(artifact, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    _, out = artifact("qwenimage21", "w8a8", copy=True)  # linked, it is refused for its links out of it
    with pytest.raises(InputError, match="already quantized"):
        ditq.quantize(out, tmp_path / "again", "w8a8")


def test_unknown_scheme_and_device(model_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    source = model_dir("wan")
    with pytest.raises(InputError, match="did you mean"):
        ditq.quantize(source, tmp_path / "out", "int8w")
    if not torch.cuda.is_available():
        with pytest.raises(InputError, match="no CUDA device"):
            ditq.quantize(source, tmp_path / "out", "w8a8", device="cuda")


def test_interrupt_leaves_nothing(model_dir, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    source = model_dir("flux")
    calls = []
    original = rewrite._encode_on

    def interrupted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(rewrite, "_encode_on", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ditq.quantize(source, tmp_path / "out", "w8a8")
    assert sorted(p.name for p in tmp_path.iterdir()) == [source.parent.name]


def test_disk_full_is_a_failure_and_leaves_nothing(model_dir, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    source = model_dir("flux")

    def full(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ShardSetWriter, "_emit", full)
    with pytest.raises(DitqError, match="No space left") as info:
        ditq.quantize(source, tmp_path / "out", "w8a8")
    assert not isinstance(info.value, InputError)
    assert sorted(p.name for p in tmp_path.iterdir()) == [source.parent.name]


_MEMORY_CHILD = """
import json, sys
from pathlib import Path
import ditq.quantization.quantizer  # noqa: F401 - warm the import before the peak is reset
import ditq
from ditq.quantization.targets import build_meta_model
from ditq.runtime.loader import component_entries

def status(key):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

source, out = Path(sys.argv[1]), Path(sys.argv[2])
transformer = source / "transformer"
build_meta_model(transformer, "diffusers", "QwenImage21Transformer2DModel", component_entries(transformer, None))  # warm
Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current RSS
base = status("VmRSS")
ditq.quantize(source, out, "w8a8")
print(json.dumps({"base": base, "peak": status("VmHWM")}))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak-RSS reset")
def test_peak_memory_bounded_by_largest_tensor(tmp_path: Path) -> None:
    """236 MB of BF16 weights whose largest tensor is 8.4 MB: the quantizer's peak RSS growth stays
    within 3 x largest + 300 MB, and below half the model (a whole-shard reader needs all of it)."""
    config = dict(
        num_layers=8,
        attention_head_dim=128,
        num_attention_heads=8,
        context_in_dim=1024,
        in_channels=64,
        out_channels=64,
        axes_dims_rope=(16, 56, 56),
    )
    with torch.device("meta"):
        model = QwenImage21Transformer2DModel(**config)
    pool = torch.randn(1 << 23, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    state = {name: pool[: t.numel()].reshape(t.shape) for name, t in model.state_dict().items()}
    model_bytes = sum(t.numel() * 2 for t in state.values())
    largest = max(t.numel() * 2 for t in state.values())
    assert (model_bytes, largest) == (235_673_600, 8_388_608)
    source = write_model_dir(tmp_path / "big", model, state=state)
    run = subprocess.run(
        [sys.executable, "-c", _MEMORY_CHILD, str(source), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    measured = json.loads(run.stdout.strip().splitlines()[-1])
    growth = measured["peak"] - measured["base"]
    assert growth <= 3 * largest + 300 * 2**20
    assert growth < model_bytes / 2, f"peak RSS grew {growth / 2**20:.0f} MiB"


def test_leftovers_of_a_killed_run_are_swept(model_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A killed run cannot clean up after itself; its temporary sibling goes on the next run."""
    source = model_dir("wan")
    leftover = tmp_path / ".ditq-tmp-out.killed"
    (leftover / "transformer").mkdir(parents=True)
    (leftover / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(b"partial")
    ditq.quantize(source, tmp_path / "out", "w8a8")
    assert not leftover.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([source.parent.name, "out"])


def _add_fp16_variant(component_dir: Path, remove_default: bool) -> None:
    """Save the component's weights again as ``<stem>.fp16.safetensors`` (diffusers' variant naming)."""
    default = [p for p in component_dir.iterdir() if p.name.endswith((".safetensors", ".index.json"))]
    stem = "model" if (component_dir / "model.safetensors").exists() else "diffusion_pytorch_model"
    state = {n: t.to(torch.float16) for n, t in _tensors(component_dir).items()}
    save_file(state, str(component_dir / f"{stem}.fp16.safetensors"), metadata={"format": "pt"})
    for path in default if remove_default else []:
        path.unlink()


def test_variant_files_beside_the_default_are_not_copied(model_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    source = model_dir("flux", shards=2)
    _add_fp16_variant(source / "transformer", remove_default=False)
    out = tmp_path / "out"
    ditq.quantize(source, out, "w8a8")
    assert sorted(p.name for p in (out / "transformer").iterdir()) == [
        "config.json",
        "diffusion_pytorch_model.safetensors",
        "diffusion_pytorch_model.safetensors.index.json",
    ]
    report = ditq.verify(out, source)
    assert report.ok, report.table()


def test_variant_only_source_needs_and_takes_variant(model_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    source = model_dir("flux", text_encoder=True)
    for component in ("transformer", "text_encoder"):
        _add_fp16_variant(source / component, remove_default=True)
    with pytest.raises(
        InputError, match=r"no \.safetensors weights \(variants here: fp16; choose one with --variant\)"
    ):
        ditq.quantize(source, tmp_path / "refused", "w8a16")
    assert not (tmp_path / "refused").exists()

    out = tmp_path / "out"
    result = ditq.quantize(source, out, "w8a16", components=["transformer", "text_encoder"], variant="fp16")
    assert result.manifest["options"]["variant"] == "fp16"
    assert (out / "text_encoder/model.safetensors").is_file()  # the quantized weights carry no variant
    assert (
        _tensors(out / "transformer")["x_embedder.weight"].dtype == torch.float16
    )  # kept from the fp16 files
    report = ditq.verify(out, source)
    assert report.ok, report.table()
