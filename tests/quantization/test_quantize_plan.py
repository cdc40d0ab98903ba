"""quantize --plan: one component, several compressed-tensors config groups (one per scheme, its layers by name)
plus ignore, as compressed-tensors writes mixed precision; compressed-tensors' own parser and file-level
decompressor read every layer back; a bad plan is a one-line error naming the file and field, and writes nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import MIXED_FLUX_LAYERS, plan_file

import ditq
from ditq.checkpoint.codecs import is_quantized_tensor
from ditq.checkpoint.manifest import read_manifest
from ditq.cli import main
from ditq.numerics import relative_l2
from ditq.plan import plan_sha256, read_plan, write_plan
from ditq.quantization.plan_apply import KEPT_BY_PLAN, NOT_IN_PLAN
from ditq.quantization.verifier import REL_L2_BOUNDS
from ditq.schemes import SCHEMES

WEIGHTS = "diffusion_pytorch_model.safetensors"
QUANTIZED = {name: choice for name, choice in MIXED_FLUX_LAYERS.items() if choice != "keep"}


def _qconfig(artifact: Path) -> dict:  # type: ignore[type-arg]
    return json.loads((artifact / "transformer/config.json").read_text())["quantization_config"]


def test_one_group_per_scheme_targets_its_layers(mixed_artifact: tuple[Path, Path, Path]) -> None:
    _, artifact, _ = mixed_artifact
    config = _qconfig(artifact)
    assert config["format"] == "mixed-precision"  # the groups' formats differ
    groups = config["config_groups"]
    assert list(groups) == ["group_0", "group_1", "group_2"]  # w8a16, w8a8, fp8: the order of SCHEMES
    planned = [
        s for s in SCHEMES.values() if s.name in set(QUANTIZED.values())
    ]  # the plan's, in SCHEMES' order
    for group, scheme in zip(groups.values(), planned, strict=True):
        assert group["format"] == scheme.format
        assert group["targets"] == sorted(n for n, s in QUANTIZED.items() if s == scheme.name)
        assert ("input_activations" in group) == (scheme.activations is not None)
    ignore = set(config["ignore"])
    assert not ignore & set(QUANTIZED)
    assert {"single_transformer_blocks.0.proj_out", "transformer_blocks.0.attn.add_q_proj"} <= ignore  # keep
    assert "transformer_blocks.0.attn.add_k_proj" in ignore  # not named by the plan
    assert "x_embedder" in ignore  # the structural rule's boundary


def test_manifest_records_the_plan(mixed_artifact: tuple[Path, Path, Path]) -> None:
    _, artifact, plan = mixed_artifact
    manifest = read_manifest(artifact)
    assert manifest["options"]["plan"] == str(plan) and manifest["options"]["scheme"] is None
    assert manifest["plan"] == {
        "path": str(plan),
        "sha256": plan_sha256(read_plan(plan)),  # write_plan's bytes are the file's
        "component": "transformer",
        "layers": {"w8a16": 2, "w8a8": 3, "fp8": 4, "keep": 2},
    }
    assert [s["name"] for s in manifest["schemes"]] == ["w8a16", "w8a8", "fp8"] and "scheme" not in manifest
    component = manifest["components"]["transformer"]
    assert component["quantized"] == sorted(QUANTIZED)
    assert component["ignored"]["transformer_blocks.0.attn.add_q_proj"] == KEPT_BY_PLAN
    assert component["ignored"]["transformer_blocks.0.attn.add_k_proj"] == NOT_IN_PLAN
    assert component["quantization_config"] == _qconfig(artifact)


def test_compressed_tensors_decodes_every_layer(
    mixed_artifact: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    from compressed_tensors.entrypoints.convert.convert_checkpoint import convert_checkpoint
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer
    from compressed_tensors.quantization import QuantizationConfig

    source, artifact, _ = mixed_artifact
    parsed = QuantizationConfig.model_validate(_qconfig(artifact))
    planned = [s for s in SCHEMES.values() if s.name in set(QUANTIZED.values())]
    assert [g.format for g in parsed.config_groups.values()] == [s.format for s in planned]

    dequantizer = CompressedTensorsDequantizer(artifact / "transformer", dtype=torch.float32)
    convert_checkpoint(artifact / "transformer", tmp_path / "dequantized", dequantizer, device="cpu")
    theirs: dict[str, torch.Tensor] = {}
    for path in sorted((tmp_path / "dequantized").glob("*.safetensors")):
        theirs.update(load_file(str(path)))
    original = load_file(str(source / "transformer" / WEIGHTS))
    assert not [n for n, t in theirs.items() if is_quantized_tensor(n, t.dtype)]  # nothing left encoded
    assert set(theirs) == set(original)
    for name, scheme in QUANTIZED.items():
        weight = theirs[f"{name}.weight"]
        assert weight.dtype == torch.float32
        assert 0 < relative_l2(weight, original[f"{name}.weight"].float()) <= REL_L2_BOUNDS[scheme], name
    for name, tensor in original.items():  # every kept tensor, byte for byte
        if name.removesuffix(".weight") not in QUANTIZED:
            assert torch.equal(theirs[name], tensor), name


def test_single_scheme_plan_keeps_its_format(model_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    source = model_dir("flux")
    layers = {"transformer_blocks.0.attn.to_q": "fp8", "transformer_blocks.0.attn.to_k": "keep"}
    result = ditq.quantize(source, tmp_path / "out", plan=plan_file(source, layers))
    config = _qconfig(tmp_path / "out")
    assert config["format"] == "float-quantized"  # one format: it, not mixed-precision
    assert [g["targets"] for g in config["config_groups"].values()] == [["transformer_blocks.0.attn.to_q"]]
    assert result.manifest["plan"]["path"] is None  # given in memory
    assert result.manifest["plan"]["layers"] == {"fp8": 1, "keep": 1}


def _write_raw(path: Path, source: Path, **changes: object) -> Path:
    raw = json.loads(plan_file(source).model_dump_json())
    raw.update(changes)
    path.write_text(json.dumps(raw))
    return path


# (what to change in the plan, the flags beside --plan, what the one line says)
BAD_PLANS = [
    (
        {"layers": {"transformer_blocks.0.attn.to_qq": "fp8"}},
        [],
        "PLAN.json: layers.transformer_blocks.0.attn.to_qq: transformer has no layer of that name; "
        "did you mean 'transformer_blocks.0.attn.to_q'?",
    ),
    (
        {"layers": {"x_embedder": "fp8"}},
        [],
        "PLAN.json: layers.x_embedder: the quantizer keeps it in source precision (boundary: outside the "
        "repeated blocks",
    ),
    (
        {"layers": {"transformer_blocks.0.attn.norm_q": "w8a8"}},
        [],
        "layers.transformer_blocks.0.attn.norm_q: the quantizer keeps it in source precision (not a Linear",
    ),
    ({"schemes": ["fp8", "int4"]}, [], "PLAN.json: schemes: unknown scheme 'int4'"),
    (
        {"layers": {"transformer_blocks.0.attn.to_q": "w4a16"}},
        [],
        "layers.transformer_blocks.0.attn.to_q: 'w4a16'",
    ),
    ({"format": "ditq-plan-0"}, [], "PLAN.json: format: Input should be 'ditq-plan-1'"),
    ({"component": "vae"}, [], "PLAN.json: component: 'vae' is not a component of"),
    (
        {"layers": {"transformer_blocks.0.attn.to_q": "keep"}},
        [],
        "PLAN.json: layers: the plan quantizes no layer",
    ),
    ({}, ["--scheme", "fp8"], "--plan and --scheme are mutually exclusive"),
    ({}, ["--ignore", "to_q"], "--plan and --ignore are mutually exclusive"),
    ({}, ["--components", "text_encoder"], "a plan quantizes its own component only"),
]


@pytest.mark.parametrize(("changes", "flags", "message"), BAD_PLANS, ids=[m[:40] for *_, m in BAD_PLANS])
def test_bad_plan_is_one_line_and_writes_nothing(
    changes, flags, message, model_dir, tmp_path: Path, capsys
) -> None:  # type: ignore[no-untyped-def]
    source = model_dir("flux")
    plan = _write_raw(tmp_path / "PLAN.json", source, **changes)
    out = tmp_path / "out"
    assert main(["quantize", str(source), str(out), "--plan", str(plan), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ditq quantize: error:"), err
    assert message in err[0], err[0]
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["PLAN.json", "src-0"]  # no temporary, no lock left


def test_plan_file_that_is_not_json(model_dir, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    plan = tmp_path / "PLAN.json"
    plan.write_text("{not json")
    assert main(["quantize", str(model_dir("flux")), str(tmp_path / "out"), "--plan", str(plan)]) == 2
    assert f"{plan}: not valid JSON" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_plan_from_the_command_line_matches_the_api(mixed_artifact, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    source, artifact, plan = mixed_artifact
    copy = tmp_path / "PLAN.json"
    write_plan(copy, read_plan(plan))
    assert main(["quantize", str(source), str(tmp_path / "out"), "--plan", str(copy)]) == 0
    assert "9 tensors quantized" in capsys.readouterr().out
    for name in ("config.json", WEIGHTS):  # byte-identical output for the same input and plan
        assert (tmp_path / "out/transformer" / name).read_bytes() == (
            artifact / "transformer" / name
        ).read_bytes()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        # a layer given twice: json alone keeps the last scheme, silently
        (
            lambda text: text.replace(
                '"layers": {', '"layers": {"transformer_blocks.0.attn.to_q": "w8a8", ', 1
            ),
            "key 'transformer_blocks.0.attn.to_q' given twice",
        ),
        (
            lambda text: text.replace('"db": ', '"db": NaN, "unused_db": ', 1),
            "NaN is not a number a plan can hold",
        ),
        (
            lambda text: text.replace('"db": ', '"db": Infinity, "unused_db": ', 1),
            "target.db: Input should be",
        ),
    ],
    ids=["duplicate-layer", "nan", "infinite-target"],
)
def test_a_plan_with_a_twice_given_layer_or_a_non_finite_target_is_one_line(
    edit, message, model_dir, tmp_path: Path, capsys
) -> None:  # type: ignore[no-untyped-def]
    source = model_dir("flux")
    plan = _write_raw(tmp_path / "PLAN.json", source)
    plan.write_text(edit(plan.read_text()))
    assert main(["quantize", str(source), str(tmp_path / "out"), "--plan", str(plan)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "out").exists()
