"""GPTQ calibration in memory and through ``ditq quantize --calibrate gptq``: Hessians in groups that fit the memory
asked for, every target rounded from its own Hessian before any is swapped, the refusals in one line, and the
artifact on the bundled demo model: written, verified by compressed-tensors' decoder, recorded, loaded and run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import ditq
from ditq.calibration import check_scheduler_steps
from ditq.checkpoint.layout import read_model_index
from ditq.checkpoint.manifest import read_manifest
from ditq.cli import main
from ditq.demo import default_model_dir, load_demo_pipeline
from ditq.errors import InputError
from ditq.numerics import dequantize_weight, quantize_weight, relative_l2
from ditq.quantization.calibrated import Calibration, calibrated_layers, hessian_groups
from ditq.runtime.adapter import model_scheduler
from ditq.schemes import FP8, W4A16

K = 128


def _layers() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(K, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))


def _correlated(rows: int, seed: int) -> torch.Tensor:
    """Inputs whose channels are strongly correlated (what makes GPTQ's error feedback pay)."""
    g = torch.Generator().manual_seed(seed)
    mixing = torch.randn(K, K, generator=torch.Generator().manual_seed(99)) / K**0.5
    return (torch.randn(rows, K, generator=g) * torch.linspace(0.1, 3.0, K)) @ mixing


def test_groups_fit_the_memory_and_a_layer_too_large_is_named() -> None:
    size = K * K * 4
    assert hessian_groups({"a": K, "b": K, "c": K}, 2 * size) == [["a", "b"], ["c"]]
    assert hessian_groups({"a": K, "b": K}, 10 * size) == [["a", "b"]]
    with pytest.raises(
        InputError, match=r"^b: its input Hessian \(256 x 256, .*\) exceeds --calibration-memory"
    ):
        hessian_groups({"a": K, "b": 256}, 2 * size)


def test_gptq_layers_beat_round_to_nearest_on_held_out_inputs_and_leave_the_module_alone() -> None:
    model = _layers()
    before = {n: t.clone() for n, t in model.state_dict().items()}
    passes = []

    def run() -> None:
        passes.append(1)
        with torch.no_grad():
            model(_correlated(2048, seed=1))

    scheme = W4A16.with_group_size(32)
    calibration = Calibration(run=run, memory_bytes=K * K * 4)  # exactly one Hessian: one pass
    stored = calibrated_layers(model, {"0": scheme}, calibration)
    assert len(passes) == 1 and list(stored) == ["0"]
    assert all(torch.equal(t, model.state_dict()[n]) for n, t in before.items())
    codec_q, codec_scale = ditq.checkpoint.codecs.codec_for(scheme).read(stored["0"].tensors)
    weight = model[0].weight.detach()
    held_out = _correlated(1024, seed=7)
    gptq_error = (held_out @ (dequantize_weight(codec_q, codec_scale) - weight).T).norm()
    rtn_error = (held_out @ (dequantize_weight(*quantize_weight(weight, scheme)) - weight).T).norm()
    assert gptq_error < 0.8 * rtn_error, (float(gptq_error), float(rtn_error))
    assert 0 < stored["0"].rel_l2 < 0.3


def test_refusals_are_one_line() -> None:
    model = _layers()
    calibration = Calibration(run=lambda: None)
    with pytest.raises(InputError, match=r"^--calibrate gptq rounds int weights .*; 0 is fp8$"):
        calibrated_layers(model, {"0": FP8}, calibration)
    with pytest.raises(InputError, match=r"^0: the calibration requests never ran this layer"):
        calibrated_layers(model, {"0": W4A16.with_group_size(None)}, calibration)
    nan_inputs = Calibration(run=lambda: model(torch.full((3, K), math.nan)))
    with pytest.raises(
        InputError, match=r"^0: the calibration requests gave it no finite input \(3 rows with a NaN"
    ):
        calibrated_layers(model, {"0": W4A16.with_group_size(None)}, nan_inputs)
    with pytest.raises(InputError, match="--calibration-memory must be positive"):
        Calibration(run=lambda: None, memory_bytes=0)


def test_the_manifest_records_each_layers_calibration_rows_left_out_of_its_hessian(tmp_path: Path) -> None:
    pipeline = load_demo_pipeline()
    poisoned = "transformer_blocks.1.attn.to_q"
    linear = pipeline.transformer.get_submodule(poisoned)
    rows = torch.randn(7, linear.in_features, generator=torch.Generator().manual_seed(3))
    rows[2:5, 0] = math.nan  # three rows a request computed NaN in, as Qwen-Image's one step does
    rows[5, 1] = math.inf

    def run() -> None:  # one small request, then the poisoned rows into one layer alone
        with torch.no_grad():
            pipeline(prompt="a red circle", num_inference_steps=1, width=64, height=64,
                     generator=torch.Generator().manual_seed(0))  # fmt: skip
            linear(rows)

    ditq.quantize_(pipeline, "w4a16", calibration=Calibration(run=run))
    ditq.save(pipeline, tmp_path / "out")
    components = read_manifest(tmp_path / "out")["components"]
    left_out = components["transformer"]["calibration_rows_left_out"]
    assert list(left_out) == [poisoned] and left_out[poisoned]["left_out"] == 4
    assert left_out[poisoned]["of"] > 4  # the request's rows too, all kept
    assert all(c["calibration_rows_left_out"] == {} for n, c in components.items() if n != "transformer")
    assert ditq.verify(tmp_path / "out").ok


def test_a_scheduler_that_computes_nan_sigmas_at_the_calibration_steps_is_refused() -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler

    # Qwen-Image's: the shift stretched to a terminal value, which divides by zero at one step
    terminal = FlowMatchEulerDiscreteScheduler(shift_terminal=0.02, use_dynamic_shifting=True)
    before = terminal.sigmas.clone()
    with pytest.raises(InputError, match=r"^--calibration-steps 1: the model's scheduler "
                       r"\(FlowMatchEulerDiscreteScheduler\) computes a NaN or infinite sigma at 1 step"):  # fmt: skip
        check_scheduler_steps(terminal, 1)
    check_scheduler_steps(terminal, 2)
    assert torch.equal(terminal.sigmas, before)  # a copy was set: the pipeline's own is untouched
    check_scheduler_steps(FlowMatchEulerDiscreteScheduler(), 1)  # no terminal: fine
    check_scheduler_steps(None, 1)  # no scheduler: nothing to judge


def test_a_model_directorys_scheduler_is_judged_from_its_config_and_only_diffusers_own(
    tmp_path: Path,
) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler

    FlowMatchEulerDiscreteScheduler(shift_terminal=0.02, use_dynamic_shifting=True).save_config(
        tmp_path / "scheduler"
    )
    index = tmp_path / "model_index.json"
    index.write_text(json.dumps({"scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"]}))
    with pytest.raises(InputError, match=r"^--calibration-steps 1: the model's scheduler"):
        check_scheduler_steps(model_scheduler(tmp_path, read_model_index(tmp_path)), 1)
    check_scheduler_steps(model_scheduler(tmp_path, read_model_index(tmp_path)), 2)
    # not a scheduler of diffusers' own: left to quantize's check, once the model is open
    for entry in (
        ["diffusers", "AutoencoderKL"],
        ["diffusers", "NoSuchScheduler"],
        ["mylib", "FlowMatchEulerDiscreteScheduler"],
    ):
        index.write_text(json.dumps({"scheduler": entry}))
        check_scheduler_steps(model_scheduler(tmp_path, read_model_index(tmp_path)), 1)


def test_quantize_calibrate_gptq_on_the_demo_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "w4a8-gptq"
    args = ["--scheme", "w4a8", "--calibrate", "gptq", "--calibration-seeds", "0", "--calibration-steps", "2"]
    assert main(["quantize", str(default_model_dir()), str(out), *args, "--device", "cpu"]) == 0
    calibration = read_manifest(out)["options"]["calibration"]
    assert calibration["method"] == "gptq" and calibration["seeds"] == [0] and calibration["steps"] == 2
    assert calibration["act_order"] is True and calibration["damp"] == 0.01
    assert calibration["requests"] == len(calibration["fixtures"]) and calibration["fixtures_digest"]
    assert ditq.verify(out).ok  # compressed-tensors' decoder reads every layer as ditq does
    pipeline = ditq.load_pipeline(out, device="cpu")
    image = pipeline(prompt="a red circle", num_inference_steps=2, width=64, height=64).images[0]
    assert image.size == (64, 64)

    capsys.readouterr()
    fp8 = [
        "quantize",
        str(default_model_dir()),
        str(tmp_path / "x"),
        "--scheme",
        "fp8",
        "--calibrate",
        "gptq",
    ]
    assert main(fp8) == 2 and "--calibrate gptq rounds int weights" in capsys.readouterr().err
    other = ["quantize", str(out), str(tmp_path / "y"), "--scheme", "w4a16", "--calibrate", "gptq"]
    assert main(other) == 2 and "--fixtures and --refs are needed" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def _streamed_against_resident(tmp_path: Path, device: str, caplog: pytest.LogCaptureFixture) -> None:
    """The demo model GPTQ-rounded in w4a8 on ``device`` twice, resident and with nothing resident, compared."""
    from safetensors.torch import load_file

    from ditq.calibration import CalibrationOptions, calibrate_and_save
    from ditq.checkpoint.codecs import codec_for
    from ditq.demo import fixtures_path, references_dir
    from ditq.runtime.options import LoadOptions
    from ditq.schemes import W4A8

    def calibrated(name: str, load: LoadOptions) -> Path:
        options = CalibrationOptions(fixtures_path(), references_dir(), seeds=(0,), steps=2, load=load)
        calibrate_and_save(default_model_dir(), tmp_path / name, "w4a8", options)
        return tmp_path / name

    def layers(artifact: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        tensors = load_file(artifact / "transformer" / "diffusion_pytorch_model.safetensors")
        prefixes = {k.rsplit(".", 1)[0] for k in tensors if k.endswith(".weight_packed")}
        return {
            p: codec_for(W4A8).read(
                {k.rsplit(".", 1)[1]: t for k, t in tensors.items() if k.startswith(f"{p}.")}
            )
            for p in prefixes
        }

    cuda = device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    resident = calibrated("resident", LoadOptions(device=device))
    if cuda:
        resident_peak = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    with caplog.at_level("INFO", logger="ditq"):
        streamed = calibrated("streamed", LoadOptions(device=device, offload="auto", memory_budget_bytes=1))
    if (
        cuda
    ):  # the weights and the Hessians wait on the host: the device holds the activations and one product
        assert torch.cuda.max_memory_allocated() < resident_peak
    assert "resident nothing; streamed transformer, text_encoder" in caplog.text
    assert "held on the host to be saved" in caplog.text
    assert "Hessians summed on the host" in caplog.text  # --calibration-memory left to the host's share
    assert ditq.verify(streamed).ok
    ours, theirs = layers(resident), layers(streamed)
    assert len(ours) > 10 and ours.keys() == theirs.keys()
    source = load_file(default_model_dir() / "transformer" / "diffusion_pytorch_model.safetensors")
    flipped = 0
    for prefix, (q, scale) in ours.items():
        q_streamed, scale_streamed = theirs[prefix]
        assert torch.equal(scale, scale_streamed), prefix  # act order: static scales, from the weights
        weight = source[f"{prefix}.weight"].float()
        error, error_streamed = (
            relative_l2(dequantize_weight(*t), weight) for t in (ours[prefix], theirs[prefix])
        )
        assert abs(error_streamed / error - 1) < 0.05, (prefix, error, error_streamed)
        moved = (q.int() - q_streamed.int()).abs()
        assert cuda or float((moved > 0).float().mean()) < 0.005, prefix
        flipped += int((moved > 0).sum())
    # float32 on the CPU: the sums differ by rounding and tip 0.1 % of the codes. bfloat16 on CUDA: the streamed and
    # resident activations differ by more (an H100 flipped 7.1 % of the first layer it compared), so the rounding is held
    # to the same error, not the same codes
    assert cuda or flipped < 0.001 * sum(q.numel() for q, _ in ours.values())
    records = [read_manifest(d)["options"]["calibration"] for d in (resident, streamed)]
    assert records[0] == records[1]


def test_a_streamed_calibration_writes_what_a_resident_one_writes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``--offload`` under calibration: with nothing resident (the denoiser in diffusers' group offload, the text
    encoder in ditq's streaming hooks) every Hessian is gathered from the same requests (the same rows; sums that
    differ by float32 rounding, about 1e-7 relative: the streamed copies' matmuls), so the artifact holds the
    resident run's layers: the same scales, the same codes but for the few rounding ties those sums tip, and the
    same calibration record. The streamed layers are held on the host, and the artifact verifies. (Streamed, the
    Hessians sum on the host: on the CPU that is where they are anyway.)"""
    _streamed_against_resident(tmp_path, "cpu", caplog)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_streamed_cuda_calibration_gathers_on_the_device_and_writes_what_a_resident_one_writes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The same on CUDA: the streamed weights wait in pinned host memory, each Hessian's products are made where
    the inputs come (the device) and summed on the host, and each layer is rounded on the device, its weight and
    Hessian brought there; the device's peak stays below the resident run's."""
    _streamed_against_resident(tmp_path, "cuda", caplog)


def test_offload_and_max_memory_are_calibrations_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = str(default_model_dir())
    for flags in (["--offload", "auto"], ["--max-memory", "16GiB"]):
        out = tmp_path / flags[0].strip("-")
        assert main(["quantize", source, str(out), "--scheme", "w4a8", *flags, "--device", "cpu"]) == 2
        assert f"{flags[0]}: only with --calibrate gptq" in capsys.readouterr().err
        assert not out.exists()


@pytest.mark.parametrize("command", ["quantize", "plan"])
def test_a_calibration_memory_that_is_no_size_is_one_line_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    source, out = str(default_model_dir()), tmp_path / "out"
    for size in ("0", "lots"):
        argv = [command, source, *([str(out)] if command == "quantize" else []), "--calibration-memory", size]
        with pytest.raises(SystemExit) as stopped:
            main(argv)
        assert stopped.value.code == 2
        err = capsys.readouterr().err
        assert (
            f"argument --calibration-memory: not a positive size: '{size}'" in err and "Traceback" not in err
        )
        assert not out.exists()


def test_a_text_encoders_passes_run_few_steps_which_give_it_the_rows_every_step_count_gives() -> None:
    """A text encoder runs before the denoising loop: its Hessians from requests at two steps are the ones at any
    number of steps (bit for bit on the demo model), so its passes take ``run_before_steps``; a denoiser's, and a
    module of any other name, take ``run``."""
    from ditq.calibration import CalibrationOptions, calibration_for
    from ditq.demo import fixtures_path, references_dir
    from ditq.pipeline.open import open_pipeline
    from ditq.quantization.gptq import hessian_hooks
    from ditq.runtime.options import LoadOptions, resolve_load_options

    adapter = open_pipeline(
        default_model_dir(), resolve_load_options(LoadOptions(device="cpu", skip_doctor=True))
    )
    calibration = calibration_for(
        adapter, CalibrationOptions(fixtures_path(), references_dir(), (0,), steps=3)
    )
    encoder = adapter.pipeline.text_encoder
    # plain Linears: attention's out_proj is a subclass its module calls through its weight, never its forward
    names = [n for n, m in encoder.named_modules() if type(m) is torch.nn.Linear][:3]
    assert names
    gathered = []
    for run in (calibration.run, calibration.run_before_steps):
        assert run is not None
        with torch.no_grad(), hessian_hooks(encoder, names) as found:
            run()
        gathered.append({n: (found[n].samples, found[n].hessian) for n in names})
    for name in names:
        (rows, hessian), (rows_once, hessian_once) = gathered[0][name], gathered[1][name]
        assert rows == rows_once > 0 and torch.equal(hessian, hessian_once), name

    model = _layers()
    runs: list[str] = []

    def run_all() -> None:
        runs.append("steps")
        with torch.no_grad():
            model(_correlated(256, seed=1))

    def run_once() -> None:
        runs.append("few steps")
        with torch.no_grad():
            model(_correlated(256, seed=1))

    counted = Calibration(run=run_all, run_before_steps=run_once)
    for component in ("text_encoder_2", "transformer", "module"):
        calibrated_layers(model, {"0": W4A16.with_group_size(32)}, counted, component=component)
    assert runs == ["few steps", "steps", "steps"]


def test_hessians_summed_on_the_host_take_half_its_available_memory_in_whole_4gib() -> None:
    """``--calibration-memory``'s default under ``--offload``: half the host's available memory, whole multiples of
    4 GiB (a rerun after a kill cuts the same groups), never below 4 GiB; 4 GiB where the host does not say."""
    from ditq.calibration import host_share
    from ditq.quantization.defaults import CALIBRATION_MEMORY

    gib = 2**30
    assert 4 * gib == CALIBRATION_MEMORY
    assert host_share(None) == host_share(0) == host_share(7 * gib) == 4 * gib
    assert host_share(90 * gib) == host_share(95 * gib) == 44 * gib
    assert host_share(96 * gib) == 48 * gib
