"""The quantize and verify commands: thin layers over the API, with its defaults and exit codes 0/1/2."""

from __future__ import annotations

import argparse
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ditq.cli import COMMANDS, main
from ditq.commands import quantize as quantize_command
from ditq.quantization.quantizer import quantize


def _parse(module, argv: list[str]) -> argparse.Namespace:  # type: ignore[no-untyped-def]
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(argv)


def test_cli_defaults_are_the_api_defaults() -> None:
    args = _parse(quantize_command, ["src", "out"])
    signature = inspect.signature(quantize).parameters
    assert args.scheme is signature["scheme"].default is None  # the API's: DEFAULTS["scheme"] without a plan
    assert args.components is signature["components"].default is None
    assert args.plan is signature["plan"].default is None
    assert args.config_form == signature["config_form"].default
    assert args.device == signature["device"].default
    assert (args.copy, args.force, args.group_size) == (False, False, None)
    assert args.follow_links is signature["follow_links"].default is False
    assert args.targets == [] and args.ignore == []


def test_quantize_then_verify(model_dir, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    source = model_dir("flux", text_encoder=True)
    out = tmp_path / "out"
    code = main(
        [
            "quantize",
            str(source),
            str(out),
            "--scheme",
            "int8wo",
            "--components",
            "transformer,text_encoder",
            "--ignore",
            "proj_mlp$",
            "--json",
        ]
    )
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["statistics"]["quantized_tensors"] == 30  # 22 + 10 (T5 keeps wo) minus the two proj_mlp
    assert main(["verify", str(out), "--source", str(source), "--json", str(tmp_path / "report.json")]) == 0
    assert "OK: " in capsys.readouterr().out
    assert json.loads((tmp_path / "report.json").read_text())["ok"] is True
    shard = out / "transformer" / "diffusion_pytorch_model.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert main(["verify", str(out)]) == 1
    assert "FAIL  files" in capsys.readouterr().out


USAGE_ERRORS = [
    (["quantize", "{src}", "{out}", "--scheme", "w8a9"], "did you mean 'w8a8'"),
    (["quantize", "{tmp}", "{out}"], "not a diffusers model directory"),
    (["quantize", "{src}", "{out}", "--components", "vae"], "no component 'vae'"),
    (["quantize", "{src}", "{out}", "--ignore", "("], "not a valid regular expression"),
    (
        ["quantize", "{src}", "{out}", "--scheme", "w8a8", "--group-size", "128"],
        "w8a16 and the 4-bit schemes only",
    ),
    *(
        (
            ["quantize", "{src}", "{out}", "--scheme", "w4a8", "--group-size", value],
            f"--group-size {value!r}: a positive number of input features per scale, or 'channel'",
        )
        for value in ("chanel", "0", "-3")
    ),
    (["verify", "{src}"], "neither a ditq artifact"),
]


@pytest.mark.parametrize(("argv", "message"), USAGE_ERRORS, ids=[m for _, m in USAGE_ERRORS])
def test_input_errors_exit_2_with_one_line(argv, message, model_dir, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    source = model_dir("wan")
    values = {"src": str(source), "out": str(tmp_path / "out"), "tmp": str(tmp_path)}
    assert main([a.format(**values) for a in argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and err[0].startswith(f"ditq {argv[0]}: error:")
    assert not (tmp_path / "out").exists()


def test_console_script_runs(model_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    source = model_dir("qwenimage21")
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "ditq.cli",
            "quantize",
            str(source),
            str(tmp_path / "out"),
            "--scheme",
            "fp8",
            "--config-form",
            "wrapped",
        ],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    assert "14 tensors quantized" in run.stdout
    again = subprocess.run(
        [sys.executable, "-m", "ditq.cli", "quantize", str(source), str(tmp_path / "out")],
        capture_output=True,
        text=True,
    )
    assert again.returncode == 2 and "already exists" in again.stderr


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_commands_help_prints(command: str, capsys) -> None:  # type: ignore[no-untyped-def]
    """--help formats every option's help (a bare % in one once made argparse raise instead of printing)."""
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    assert f"usage: ditq {command}" in capsys.readouterr().out


def test_version_and_logging_options_before_or_after_the_command(capsys) -> None:  # type: ignore[no-untyped-def]
    import logging

    import ditq

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"ditq {ditq.__version__}"
    root = logging.getLogger()
    kept, kept_level = list(root.handlers), root.level
    try:
        for argv, level in (
            (["-v", "doctor"], logging.DEBUG),
            (["doctor", "-v"], logging.DEBUG),
            (["doctor", "--quiet"], logging.WARNING),
            (["doctor"], logging.INFO),
        ):
            for handler in list(root.handlers):  # basicConfig configures only an unconfigured root logger
                root.removeHandler(handler)
            assert main([*argv, "--device", "cpu", "--geometry", "64x32", "--rows", "4"]) == 0
            assert root.level == level, argv
    finally:  # the handlers main() added write to this test's captured stream, which closes with it
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in kept:
            root.addHandler(handler)
        root.setLevel(kept_level)


@pytest.mark.skipif(sys.platform != "linux", reason="file-size limits as Linux applies them")
def test_a_write_the_system_refuses_is_one_line_and_leaves_nothing(tmp_path: Path) -> None:
    """Issue 28, item 13: a full disk (here: a file-size limit, which fails writes the same way) was a traceback."""
    import resource
    import shutil
    import signal

    from ditq.demo import default_model_dir

    shutil.copy(default_model_dir().parent / "references" / "ref-circle-green.png", tmp_path)
    (tmp_path / "prompts.txt").write_text(
        "edit-1: ref-circle-green: a green circle on sand\ngen-1: a red fox\n"
    )

    def small_files() -> None:  # in the child: writes past 64 bytes fail with EFBIG instead of a signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ditq.cli",
            "fixtures",
            "init",
            str(tmp_path),
            "--out",
            str(tmp_path / "fixtures"),
        ],
        preexec_fn=small_files,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    assert done.stderr == f"ditq fixtures: error: {tmp_path / 'fixtures'}: File too large\n", done.stderr
    assert not (tmp_path / "fixtures").exists()  # nothing half-written
