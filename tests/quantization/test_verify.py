"""verify: passes on a fresh artifact, fails on any flipped byte, and catches re-sealed tampering."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import ditq
from ditq.checkpoint.codecs import PackQuantizedCodec
from ditq.checkpoint.manifest import MANIFEST, MANIFEST_SEAL, file_records, read_manifest, write_manifest
from ditq.errors import InputError
from ditq.quantization.verifier import REL_L2_BOUNDS, verify

WEIGHTS = "transformer/diffusion_pytorch_model.safetensors"


def _reseal(out: Path) -> None:
    """Recompute every digest, as a careful forger would, so only the content checks can object."""
    manifest = read_manifest(out)
    manifest["files"] = file_records(out, skip_dirs=set(manifest["linked"]))
    write_manifest(out, manifest)


def _edit_weights(out: Path, edit) -> None:  # type: ignore[no-untyped-def]
    tensors = load_file(str(out / WEIGHTS))
    edit(tensors)
    save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})
    _reseal(out)


def _failed(report) -> list[str]:  # type: ignore[no-untyped-def]
    return [c.name for c in report.checks if not c.ok]


def _detail(report, name: str) -> str:  # type: ignore[no-untyped-def]
    (check,) = [c for c in report.checks if c.name == name]
    return check.detail


@pytest.mark.parametrize("scheme", ["w8a16", "w8a8", "fp8"])
def test_fresh_artifact_passes(scheme: str, artifact) -> None:  # type: ignore[no-untyped-def]
    source, out = artifact(
        "flux", scheme, shards=2, text_encoder=True, components=["transformer", "text_encoder"]
    )
    report = verify(out, source)
    assert report.ok, report.table()
    names = [c.name for c in report.checks]
    assert {
        "manifest seal",
        "files",
        "transformer: decode",
        "transformer: source",
        "text_encoder: source",
    } <= set(names)
    assert len(report.tensors) == 32  # 22 in the transformer, 10 in the T5 encoder (its wo kept)
    assert all(t["decoders_agree"] and t["scale_ok"] for t in report.tensors)
    assert all(0 < t["rel_l2"] <= REL_L2_BOUNDS[scheme] for t in report.tensors)
    assert verify(out).ok  # without the source


def test_grouped_w8a16_passes(artifact) -> None:  # type: ignore[no-untyped-def]
    source, out = artifact("qwenimage21", "w8a16", group_size=16)
    report = verify(out, source)
    assert report.ok, report.table()


def test_flipping_any_byte_fails(artifact) -> None:  # type: ignore[no-untyped-def]
    _, out = artifact("wan", "w8a16", copy=True)
    files = sorted(p for p in out.rglob("*") if p.is_file())
    assert len(files) >= 7
    for path in files:
        original = path.read_bytes()
        for position in sorted({0, len(original) // 2, len(original) - 1}):
            data = bytearray(original)
            data[position] ^= 0x01
            path.write_bytes(bytes(data))
            report = verify(out)
            assert not report.ok, f"flipping byte {position} of {path.relative_to(out)} went unnoticed"
        path.write_bytes(original)
    assert verify(out).ok


def test_missing_extra_and_relinked(artifact, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    _, out = artifact("sd3", "w8a8")
    (out / "transformer" / "notes.txt").write_text("extra")
    assert "extra transformer/notes.txt" in _detail(verify(out), "files")
    (out / "transformer" / "notes.txt").unlink()
    (out / "tensor_errors.json").unlink()
    assert "missing tensor_errors.json" in _detail(verify(out), "files")
    other = tmp_path / "elsewhere"
    other.mkdir()
    (out / "scheduler").unlink()
    (out / "scheduler").symlink_to(other)
    assert "link scheduler" in _detail(verify(out), "files")


def test_resealed_negative_scale_fails(artifact) -> None:  # type: ignore[no-untyped-def]
    _, out = artifact("flux", "w8a8")
    _edit_weights(out, lambda t: t["transformer_blocks.0.attn.to_q.weight_scale"].neg_())
    report = verify(out)
    assert _failed(report) == ["transformer: decode"]
    assert "to_q: weight_scale holds negative values" in report.checks[-1].detail


def test_resealed_scale_too_large_for_float32_fails(artifact) -> None:  # type: ignore[no-untyped-def]
    """Issue 28, item 8: 3e38 is finite and positive, and every weight it scales is Inf."""
    _, out = artifact("flux", "w8a8")
    _edit_weights(out, lambda t: t["transformer_blocks.0.attn.to_q.weight_scale"].fill_(3e38))
    report = verify(out)
    assert _failed(report) == ["transformer: decode"]
    assert (
        "to_q: weight_scale 3e+38 is out of range: 127 times it overflows float32" in report.checks[-1].detail
    )


MISTYPED_MANIFEST = {
    "class not a pair": (("components", "transformer", "class"), 5, "components.transformer.class:"),
    "file size a string": (("files", "model_index.json", "size"), "12", "files.model_index.json.size:"),
    "link not a path": (("linked", "scheduler"), 3, "linked.scheduler:"),
    "options not an object": (("options",), "fast", "options:"),
}


@pytest.mark.parametrize("field", sorted(MISTYPED_MANIFEST))
def test_mistyped_manifest_field_fails_in_one_line(field: str, artifact) -> None:  # type: ignore[no-untyped-def]
    """Issue 28, item 13: a wrongly typed field of a resealed manifest was a traceback."""
    _, out = artifact("flux", "w8a8")
    keys, value, message = MISTYPED_MANIFEST[field]
    manifest = read_manifest(out)
    node = manifest
    for key in keys[:-1]:
        node = node[key]
    node[keys[-1]] = value
    write_manifest(out, manifest)
    report = verify(out)
    assert _failed(report) == ["manifest parses"]
    detail = _detail(report, "manifest parses")
    assert "\n" not in detail and MANIFEST in detail and message in detail, detail
    with pytest.raises(InputError, match=message):
        read_manifest(out)


def test_resealed_weight_change_fails_against_source(artifact) -> None:  # type: ignore[no-untyped-def]
    source, out = artifact("flux", "w8a8")
    _edit_weights(out, lambda t: t["transformer_blocks.0.attn.to_q.weight"].neg_())
    assert verify(out).ok  # self-consistent: only the source can tell
    report = verify(out, source)
    assert _failed(report) == ["transformer: source"]
    assert "to_q: rel-L2" in report.checks[-1].detail


def test_resealed_kept_tensor_change_fails_against_source(artifact) -> None:  # type: ignore[no-untyped-def]
    source, out = artifact("flux", "fp8")
    _edit_weights(out, lambda t: t["proj_out.weight"].mul_(1.01))
    report = verify(out, source)
    assert _failed(report) == ["transformer: source"]
    assert "proj_out.weight: bytes differ from the source" in report.checks[-1].detail


def test_resealed_unquantized_target_fails(artifact) -> None:  # type: ignore[no-untyped-def]
    source, out = artifact("wan", "w8a8")
    prefix = "blocks.1.attn2.to_v"

    def dequantize(t: dict[str, torch.Tensor]) -> None:
        t[f"{prefix}.weight"] = (t[f"{prefix}.weight"].float() * t.pop(f"{prefix}.weight_scale")).bfloat16()

    _edit_weights(out, dequantize)
    report = verify(out, source)
    assert "transformer: targets" in _failed(report)
    assert f"Linear {prefix} kept in source precision but not in ignore" in " ".join(
        c.detail for c in report.checks
    )


def test_decoder_disagreement_fails(artifact, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    _, out = artifact("qwenimage21", "w8a16")
    original = PackQuantizedCodec.decode
    monkeypatch.setattr(
        PackQuantizedCodec,
        "decode",
        lambda self, stored, dtype=torch.float32: original(self, stored) * 1.0000001,
    )
    report = verify(out)
    assert _failed(report) == ["transformer: decode"]
    assert "decode differently" in report.checks[-1].detail


def test_wrong_source_fails(artifact, model_dir) -> None:  # type: ignore[no-untyped-def]
    source, out = artifact("wan", "w8a8")
    other = model_dir("wan", seed=1)
    report = verify(out, other)
    assert _failed(report) == ["scheduler: source files", "transformer: source"]
    assert (
        f"scheduler: a link to {source.resolve() / 'scheduler'}, not to {other / 'scheduler'}"
        in report.table()
    )


def test_config_changed_and_resealed_fails(artifact) -> None:  # type: ignore[no-untyped-def]
    _, out = artifact("flux", "w8a8")
    config_path = out / "transformer" / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"]["ignore"].append("transformer_blocks.0.attn.to_q")
    config_path.write_text(json.dumps(config))
    _reseal(out)
    report = verify(out)
    assert "transformer: config" in _failed(report) and "transformer: targets" in _failed(report)


def test_report_json_and_table(artifact) -> None:  # type: ignore[no-untyped-def]
    source, out = artifact("qwenimage", "fp8")
    report = ditq.verify(out, source)
    doc = json.loads(json.dumps(report.to_json()))
    assert doc["ok"] is True and doc["source"] == str(source)
    assert all(set(c) == {"name", "ok", "detail", "applicable", "status"} for c in doc["checks"])
    assert {c["name"]: c["status"] for c in doc["checks"] if c["status"] != "pass"} == {"manifest key": "n/a"}
    assert report.table().splitlines()[-1].startswith("OK:")
    (out / MANIFEST_SEAL).write_text("0" * 64 + f"  {MANIFEST}\n")
    assert verify(out).table().splitlines()[-1].startswith("FAILED:")


def test_not_an_artifact(model_dir) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(
        InputError, match=r"neither a ditq artifact \(no MANIFEST.json\) nor a compressed-tensors"
    ):
        verify(model_dir("wan"))


@pytest.mark.parametrize(
    ("where", "value"),
    [(("statistics",), float("nan")), (("components", "transformer", "statistics"), float("inf"))],
)
def test_a_manifest_whose_statistics_are_not_finite_does_not_parse(artifact, where, value) -> None:  # type: ignore[no-untyped-def]
    """The quantizer's report is finite for every artifact it writes: a NaN or an infinity in a re-sealed
    manifest fails verify naming the field, and the loader refuses it."""
    _, out = artifact("flux", "w8a8")
    manifest = read_manifest(out)
    stats = manifest
    for key in where:
        stats = stats[key]
    stats["max_rel_l2"] = value
    write_manifest(out, manifest)  # sealed again: only the fields can object
    report = verify(out)
    assert _failed(report) == ["manifest parses"]
    field = ".".join((*where, "max_rel_l2"))
    assert f"MANIFEST.json: {field}: Input should be a finite number" in _detail(report, "manifest parses")
    with pytest.raises(InputError, match=f"{field}: Input should be a finite number"):
        read_manifest(out)


def test_a_checkpoint_without_manifest_or_quantized_config_says_which_component_it_could_not_read(
    artifact,  # type: ignore[no-untyped-def]
) -> None:
    """A folder whose one quantized component lost its config.json, or became a file: verify's one line names it
    (the tokenizer's and scheduler's folders, which never have a config.json, are not named)."""
    _, out = artifact("flux", "w8a8")
    for name in ("MANIFEST.json", "MANIFEST.json.sha256"):
        (out / name).unlink()
    (out / "transformer" / "config.json").unlink()
    with pytest.raises(
        InputError, match=r"quantization_config; transformer/config.json: missing beside its weights\)$"
    ):
        verify(out)
    for path in (out / "transformer").iterdir():
        path.unlink()
    (out / "transformer").rmdir()
    (out / "transformer").write_text("{}")
    with pytest.raises(
        InputError, match=r"component 'transformer' \(diffusers.FluxTransformer2DModel\) has no folder"
    ):
        verify(out)


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def _change_shift(path: Path) -> None:
    config = json.loads(path.read_text())
    config["shift"] = 9.0
    path.write_text(json.dumps(config))


# What is behind the artifact's default links is served as part of it: a change there fails verify, named.
LINKED_TAMPERING = {
    "text encoder weights": ("text_encoder/model.safetensors", _flip_last_byte),
    "scheduler config": ("scheduler/scheduler_config.json", _change_shift),
}


@pytest.mark.parametrize("what", sorted(LINKED_TAMPERING))
def test_tampering_behind_a_link_fails_with_and_without_source(what: str, artifact) -> None:  # type: ignore[no-untyped-def]
    source, out = artifact("flux", "w8a8", text_encoder=True, components=["transformer"])
    assert (out / "text_encoder").is_symlink() and (out / "scheduler").is_symlink()
    assert verify(out, source).ok
    rel, tamper = LINKED_TAMPERING[what]
    tamper(source / rel)
    for report in (verify(out), verify(out, source)):
        assert _failed(report) == ["files"]
        assert f"altered {rel} (behind the link {rel.split('/')[0]})" in _detail(report, "files")


def test_files_added_or_removed_behind_a_link_fail(artifact) -> None:  # type: ignore[no-untyped-def]
    source, out = artifact("sd3", "w8a8")
    (source / "scheduler" / "extra.json").write_text("{}")
    (source / "scheduler" / "scheduler_config.json").unlink()
    detail = _detail(verify(out), "files")
    assert "extra scheduler/extra.json (behind the link scheduler)" in detail
    assert "missing scheduler/scheduler_config.json (behind the link scheduler)" in detail


def test_manifest_without_source_digests_cannot_vouch_for_links(artifact) -> None:  # type: ignore[no-untyped-def]
    _, out = artifact("wan", "w8a8")
    manifest = read_manifest(out)
    del manifest["source_files"]
    write_manifest(out, manifest)
    report = verify(out)
    assert _failed(report) == ["files"]
    assert "has no source_files: what scheduler link" in _detail(report, "files")


MISTYPED_QUANTIZATION_CONFIG = {
    "targets not a list": (("config_groups", "group_0", "targets"), 7, "targets is not a list"),
    "format not a string": (("format",), ["int-quantized"], "format ['int-quantized'] is not a string"),
    "ignore not a list": (("ignore",), 5, "ignore is not a list"),
}


@pytest.mark.parametrize("field", sorted(MISTYPED_QUANTIZATION_CONFIG))
def test_mistyped_quantization_config_fails_in_one_line(field: str, artifact) -> None:  # type: ignore[no-untyped-def]
    _, out = artifact("flux", "w8a8")
    keys, value, message = MISTYPED_QUANTIZATION_CONFIG[field]
    config_path = out / "transformer" / "config.json"
    config = json.loads(config_path.read_text())
    node = config["quantization_config"]
    for key in keys[:-1]:
        node = node[key]
    node[keys[-1]] = value
    config_path.write_text(json.dumps(config))
    report = verify(out)
    check = next(c for c in report.checks if c.name == "transformer: config")
    assert not check.ok and "\n" not in check.detail
    assert "transformer/config.json" in check.detail and message in check.detail, check.detail


def test_mixed_plan_artifact_passes_layer_by_layer(mixed_artifact) -> None:  # type: ignore[no-untyped-def]
    from tiny_models import MIXED_FLUX_LAYERS

    source, out, _ = mixed_artifact
    report = verify(out, source)
    assert report.ok, report.table()
    planned = {n: s for n, s in MIXED_FLUX_LAYERS.items() if s != "keep"}
    assert {t["tensor"]: t["scheme"] for t in report.tensors} == planned
    assert all(t["decoders_agree"] and 0 < t["rel_l2"] <= REL_L2_BOUNDS[t["scheme"]] for t in report.tensors)
    assert (
        "mixed-precision: group_0 w8a16 (2 targets), group_1 w8a8 (3 targets), group_2 fp8 (4 targets)"
        in (report.table())
    )


def test_mixed_plan_artifact_tampered_fails(mixed_artifact, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import shutil

    _, shared, _ = mixed_artifact
    shutil.copytree(shared.parent, tmp_path / "mixed", symlinks=True)  # with the source its links lead to
    out = tmp_path / "mixed" / shared.name
    config_path = out / "transformer/config.json"
    config = json.loads(config_path.read_text())
    groups = config["quantization_config"]["config_groups"]  # an fp8 layer moved into the w8a8 group
    groups["group_2"]["targets"].remove("transformer_blocks.0.attn.to_q")
    groups["group_1"]["targets"].append("transformer_blocks.0.attn.to_q")
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    manifest = read_manifest(out)
    manifest["components"]["transformer"]["quantization_config"] = config["quantization_config"]
    write_manifest(out, manifest)
    _reseal(out)  # a careful forger: only the content checks can object
    report = verify(out)
    assert _failed(report) == ["transformer: decode"]
    decode = next(c for c in report.checks if c.name == "transformer: decode")
    assert "transformer_blocks.0.attn.to_q: quantization_config says int-quantized" in decode.detail
    data = bytearray((out / WEIGHTS).read_bytes())  # and a flipped byte, without resealing
    data[len(data) // 2] ^= 0xFF
    (out / WEIGHTS).write_bytes(bytes(data))
    assert "files" in _failed(verify(out))
