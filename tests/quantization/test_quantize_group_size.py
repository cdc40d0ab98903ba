"""``--group-size channel``: the 4-bit schemes with one scale per output channel instead of groups of 128, on the
bundled demo model (its Linears take 256 or 768 inputs: two or six groups of 128 by default). Through the CLI, in
memory with GPTQ and the low-rank branch, and into the calibrated CLI path; compressed-tensors' decoder reads every
layer back as ditq's codec decodes it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import ditq
import ditq.calibration
from ditq.checkpoint.codecs import codec_for
from ditq.checkpoint.low_rank import LOW_RANK_DOWN, LOW_RANK_UP
from ditq.checkpoint.manifest import read_manifest
from ditq.checkpoint.reference import ReferenceDecoder
from ditq.cli import main
from ditq.demo import default_model_dir, load_demo_pipeline, plan_path
from ditq.errors import InputError
from ditq.quantization.calibrated import Calibration
from ditq.schemes import CHANNEL, W4A8


def _layers(artifact: Path) -> dict[str, dict[str, torch.Tensor]]:
    """The transformer's quantized Linears: prefix -> its stored tensors."""
    layers: dict[str, dict[str, torch.Tensor]] = {}
    for path in sorted((artifact / "transformer").glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                prefix, _, name = key.rpartition(".")
                layers.setdefault(prefix, {})[name] = f.get_tensor(key)
    return {prefix: tensors for prefix, tensors in layers.items() if "weight_scale" in tensors}


def _read_back(artifact: Path) -> dict[str, dict[str, torch.Tensor]]:
    """The quantized layers, each checked: compressed-tensors' decoder gives what ditq's codec gives."""
    config = json.loads((artifact / "transformer" / "config.json").read_text())["quantization_config"]
    decoder = ReferenceDecoder(config)
    layers = _layers(artifact)
    for prefix, tensors in layers.items():
        stored = {n: t for n, t in tensors.items() if n not in (LOW_RANK_UP, LOW_RANK_DOWN)}
        assert torch.equal(decoder.decode(stored, prefix), codec_for(W4A8).decode(stored)), prefix
    return layers


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_channel_is_one_scale_column_per_layer_from_the_cli_and_from_memory(tmp_path: Path) -> None:
    grouped, channel, memory = tmp_path / "grouped", tmp_path / "channel", tmp_path / "memory"
    ditq.quantize(default_model_dir(), grouped, "w4a8")
    argv = ["quantize", str(default_model_dir()), str(channel), "--scheme", "w4a8", "--group-size", "channel"]
    assert main(argv) == 0

    assert {t["weight_scale"].shape[1] for t in _layers(grouped).values()} == {2, 6}  # groups of 128
    layers = _read_back(channel)
    assert len(layers) == 42
    assert all(t["weight_scale"].shape == (t["weight_shape"][0], 1) for t in layers.values())
    config = json.loads((channel / "transformer" / "config.json").read_text())["quantization_config"]
    weights = [group["weights"] for group in config["config_groups"].values()]
    assert [(w["strategy"], w["num_bits"], "group_size" in w) for w in weights] == [("channel", 4, False)]
    manifest = read_manifest(channel)
    assert (manifest["options"]["group_size"], manifest["scheme"]["group_size"]) == ("channel", None)
    assert ditq.verify(channel).ok

    pipeline = load_demo_pipeline()
    ditq.quantize_(pipeline, "w4a8", group_size=CHANNEL)
    ditq.save(pipeline, memory)
    assert _files(memory) == _files(channel)  # quantize_ records the choice as ditq quantize does


def test_gptq_with_the_low_rank_branch_rounds_per_channel(tmp_path: Path) -> None:
    pipeline = load_demo_pipeline()

    def run() -> None:  # one small request: the Hessians, not the images, are what is checked here
        with torch.no_grad():
            pipeline(
                prompt="a red circle",
                num_inference_steps=1,
                width=64,
                height=64,
                generator=torch.Generator().manual_seed(0),
            )

    ditq.quantize_(pipeline, "w4a8", group_size=CHANNEL, calibration=Calibration(run=run), low_rank=8)
    ditq.save(pipeline, tmp_path / "gptq")
    layers = _read_back(tmp_path / "gptq")
    assert len(layers) == 42
    assert all(t["weight_scale"].shape[1] == 1 and t[LOW_RANK_UP].shape[1] == 8 for t in layers.values())
    options = read_manifest(tmp_path / "gptq")["options"]
    assert (options["group_size"], options["calibration"]["method"], options["low_rank"]) == (
        "channel",
        "gptq",
        8,
    )
    assert ditq.verify(tmp_path / "gptq").ok


class _Called(Exception):
    pass


def test_calibrate_gptq_takes_the_group_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def calibrate_and_save(*args: object, **kwargs: object) -> None:
        raise _Called(kwargs["group_size"])

    monkeypatch.setattr(ditq.calibration, "calibrate_and_save", calibrate_and_save)
    argv = ["quantize", str(default_model_dir()), str(tmp_path / "out"), "--calibrate", "gptq"]
    with pytest.raises(_Called) as called:
        main([*argv, "--scheme", "w4a8", "--group-size", "channel"])
    assert called.value.args == (CHANNEL,)


def test_a_plan_takes_no_group_size() -> None:
    with pytest.raises(InputError, match=r"^group_size: a plan names each layer's scheme"):
        ditq.quantize_(load_demo_pipeline(), str(plan_path()), group_size=CHANNEL)
