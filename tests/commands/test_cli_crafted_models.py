"""Crafted model directories and artifacts through the CLI: no command runs code shipped with a model, prompts,
reads stdin, or prints a traceback; each exits non-zero naming the file and the field, tensor or class.

Every case runs in one child process (``ditq.cli.main`` once per case, importing torch once), whose stdin holds
answers a prompt would take ("y"): the child reports what is left of it, so a command that read stdin shows.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tiny_models import make_model_dir

import ditq
from ditq.demo import default_model_dir

EVIL = "open({marker!r}, 'w').write('ran')\n"  # what a model's own code would do: leave a mark
ANSWERS = "y\n" * 8

CASE_SECONDS = 20  # each case is refused in well under a second; a case still running after this failed
_CHILD = """
import contextlib, io, json, signal, sys, traceback
from ditq.cli import main

class Overtime(BaseException):
    pass

def overtime(*_):
    raise Overtime

signal.signal(signal.SIGALRM, overtime)
results = {}
for case, argv in json.loads(sys.argv[1]).items():
    out, err = io.StringIO(), io.StringIO()
    signal.alarm(int(sys.argv[2]))
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except Overtime:
            code = "still running"
        except BaseException:  # a traceback would have reached the user
            code, err = "traceback", io.StringIO(traceback.format_exc())
    signal.alarm(0)
    results[case] = {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}
print(json.dumps({"results": results, "stdin_left": sys.stdin.read()}))
"""


def _update(path: Path, **fields: Any) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def _evil_code(component: Path, marker: Path) -> None:
    _update(component / "config.json", model_type="evil", auto_map={"AutoModel": "evilcode.EvilModel"})
    (component / "evilcode.py").write_text(EVIL.format(marker=str(marker)))


def _overlapping_offsets(weights: Path) -> None:
    data = weights.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    by_offset = sorted((v["data_offsets"][0], k) for k, v in header.items() if k != "__metadata__")
    second = by_offset[1][1]  # moved 4 bytes back, into the first tensor's bytes
    header[second]["data_offsets"] = [o - 4 for o in header[second]["data_offsets"]]
    raw = json.dumps(header).encode()
    weights.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + size :])


# case -> (command, what to copy: "source" | "artifact" | "bare" (an artifact without MANIFEST.json) | "demo",
#          the change, what the output must name, the exit code)
CASES: dict[str, tuple[str, str, Callable[[Path, Path], None], str, int]] = {
    "quantize: auto_map": (
        "quantize",
        "source",
        lambda d, m: _evil_code(d / "text_encoder", m),
        "text_encoder/config.json: auto_map asks for the model's own code (evilcode.EvilModel)",
        2,
    ),
    "verify without manifest: auto_map": (
        "verify",
        "bare",
        lambda d, m: _evil_code(d / "text_encoder", m),
        "text_encoder/config.json: auto_map asks for the model's own code (evilcode.EvilModel)",
        1,
    ),
    "quantize: untrusted class": (
        "quantize",
        "source",
        lambda d, m: (
            _update(d / "model_index.json", text_encoder=["evilcode", "EvilModel"]),
            (d / "text_encoder" / "evilcode.py").write_text(EVIL.format(marker=str(m))),
        ),
        "model_index.json: text_encoder: class evilcode.EvilModel is not from diffusers, transformers, ditq.demo",
        2,
    ),
    "generate: untrusted class": (
        "generate",
        "demo",
        lambda d, m: _update(d / "model_index.json", text_encoder=["evilcode", "EvilModel"]),
        "class evilcode.EvilModel is not from",
        2,
    ),
    "quantize: ../ key": (
        "quantize",
        "source",
        lambda d, m: _update(d / "model_index.json", **{"../x": ["diffusers", "X"]}),
        "model_index.json: component name '../x' is not a plain name",
        2,
    ),
    "quantize: 3-item entry": (
        "quantize",
        "source",
        lambda d, m: _update(
            d / "model_index.json", transformer=["diffusers", "FluxTransformer2DModel", "x"]
        ),
        "model_index.json: transformer: ['diffusers', 'FluxTransformer2DModel', 'x'] is not [library, class]",
        2,
    ),
    "quantize: missing config": (
        "quantize",
        "source",
        lambda d, m: (d / "transformer" / "config.json").unlink(),
        "transformer/config.json: no such file",
        2,
    ),
    "verify without manifest: FIFO config": (
        "verify",
        "bare",
        lambda d, m: (
            (d / "text_encoder" / "config.json").unlink(),
            os.mkfifo(d / "text_encoder" / "config.json"),
        ),
        "text_encoder/config.json: not a regular file (a FIFO)",
        1,
    ),
    "verify without manifest: component folder is a file": (
        "verify",
        "bare",
        lambda d, m: (shutil.rmtree(d / "transformer"), (d / "transformer").write_text("{}")),
        "component 'transformer' (diffusers.FluxTransformer2DModel) has no folder",
        1,
    ),
    "verify: num_layers": (
        "verify",
        "artifact",
        lambda d, m: _update(d / "transformer" / "config.json", num_layers=200000),
        "transformer/config.json: declares more than",
        1,
    ),
    "quantize: negative num_layers": (
        "quantize",
        "source",
        lambda d, m: _update(d / "transformer" / "config.json", num_layers=-1),
        "transformer/config.json: num_layers is -1; a count is never negative",
        2,
    ),
    "generate: NaN eps": (
        "generate",
        "demo",
        lambda d, m: _update(d / "transformer" / "config.json", eps=float("nan")),  # written as JSON's NaN
        "transformer/config.json: eps is nan; a config's numbers are finite",
        2,
    ),
    "verify: axes_dims_rope": (
        "verify",
        "artifact",
        lambda d, m: _update(d / "transformer" / "config.json", axes_dims_rope=[16777216, 6, 6]),
        "transformer/config.json: axes_dims_rope [16777216, 6, 6] adds up to 16777228",
        1,
    ),
    "verify: num_attention_heads": (
        "verify",
        "artifact",
        lambda d, m: _update(d / "transformer" / "config.json", num_attention_heads=2**20),
        "config.json declares [16777216, 256]",
        1,
    ),
    "verify: model_index class": (
        "verify",
        "artifact",
        lambda d, m: _update(d / "model_index.json", transformer=["diffusers", "SD3Transformer2DModel"]),
        "model_index.json: transformer is ['diffusers', 'SD3Transformer2DModel'], the manifest records",
        1,
    ),
    "verify without manifest: overlapping offsets": (
        "verify",
        "bare",
        lambda d, m: _overlapping_offsets(d / "transformer" / "diffusion_pytorch_model.safetensors"),
        "overlap in the file",
        1,
    ),
    "generate: axes_dims_rope": (
        "generate",
        "demo",
        lambda d, m: _update(d / "transformer" / "config.json", axes_dims_rope=[16777216, 24, 24]),
        "transformer/config.json: axes_dims_rope [16777216, 24, 24] adds up to",
        2,
    ),
    "generate: text encoder num_layers": (
        "generate",
        "demo",
        lambda d, m: _update(d / "text_encoder" / "config.json", num_layers=100000),
        "text_encoder/config.json: declares more than",
        2,
    ),
}


@pytest.fixture(scope="module")
def crafted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every case, run once in one child process: case -> {code, stdout, stderr, marker, dir}; and stdin_left."""
    root = tmp_path_factory.mktemp("crafted")
    source = make_model_dir(root, "flux", text_encoder=True)
    artifact = ditq.quantize(source, root / "artifact", "w8a8", components="transformer,text_encoder").path
    bases = {"source": source, "artifact": artifact, "bare": artifact, "demo": default_model_dir()}
    argvs: dict[str, list[str]] = {}
    dirs: dict[str, tuple[Path, Path]] = {}
    for number, (case, (command, base, change, _, _)) in enumerate(CASES.items()):
        folder, marker = root / f"case-{number}", root / f"case-{number}.ran"
        shutil.copytree(bases[base], folder, symlinks=True)
        if base == "bare":
            (folder / "MANIFEST.json").unlink()
        change(folder, marker)
        dirs[case] = (folder, marker)
        tail = {
            "quantize": [str(root / f"out-{number}"), "--scheme", "w8a8"],
            "verify": [],
            "generate": ["--prompt", "a red circle", "--steps", "1", "--out", str(root / f"{number}.png")],
        }[command]
        argvs[case] = [command, str(folder), *tail]
    run = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(argvs), str(CASE_SECONDS)],
        input=ANSWERS,
        capture_output=True,
        text=True,
        timeout=CASE_SECONDS * (len(argvs) + 1),
    )
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    for case, (folder, marker) in dirs.items():
        report["results"][case].update(dir=str(folder), marker=marker.exists())
    return report


@pytest.mark.parametrize("case", list(CASES))
def test_crafted_input_is_refused_in_one_line(case: str, crafted: dict[str, Any]) -> None:
    result = crafted["results"][case]
    command, _, _, names, code = CASES[case]
    assert result["code"] == code, result
    assert not result["marker"], "code shipped with the model ran"
    printed = result["stdout"] + result["stderr"]
    assert "Traceback" not in printed and "[y/N]" not in printed and names in printed, printed[-2000:]
    if code == 2:  # an error: one line, naming the file
        errors = [
            line for line in result["stderr"].splitlines() if line.startswith(f"ditq {command}: error:")
        ]
        assert len(errors) == 1 and result["dir"] in errors[0], result["stderr"]
    else:  # verify's report: the check that failed names the file
        assert any(line.startswith("FAIL") and names in line for line in result["stdout"].splitlines())
    assert crafted["stdin_left"] == ANSWERS  # nothing read the answers a prompt would have taken
