"""Hostile inputs through the real `ditq` CLI (issues 28 and 48): crafted from the bundled demo model, each run as
its own process and classified clean, weak or defect.

    PYTHONPATH=$PWD python tests/adversarial/attack_inputs.py   # -> benchmarks/results/attack_inputs_cpu_COMMIT.json
    PYTHONPATH=$PWD python tests/adversarial/attack_inputs.py --only paths,evidence --keep    # some groups; keep $TMP
    make test-attacks                                      # all of them, failing on any defect (what CI runs)

The groups of issue 48, by mechanism: ``outputs`` (one rule for replacing an output: --force, the current
directory, the home folder, a failed write), ``hub`` (confined resolution of a hub id through a hostile cache),
``seal`` (what loads is what is sealed, keyed or not; keys that are not UTF-8), ``diffusers`` (diffusers' own
``from_pretrained`` after ``import ditq.diffusers``, run as a person's script), ``pictures`` (one opener; bounded
text inputs), ``evidence`` (a sweep's candidates chained to their artifacts; forged runs) and ``markdown``
(REPORT.md cannot be restructured).

About 170 cases, two at a time. A fresh ``python -m ditq.cli`` spends 3-5 s importing torch and diffusers, so
most cases run as children forked from one process that imported them once (tests/adversarial/fork_server.py;
``forkable`` says which may); the others, and every case under ``--fresh``, as a fresh ``python -m ditq.cli``.

Setup (in this process, once): a copy of the demo model (``source``), its w8a8 artifact made by
``ditq.quantize`` (``artifact``; ``bare`` is the same without MANIFEST.json; ``keyed`` a --copy one sealed with
DITQ_SEAL_KEY), a three-fixture set with two
reference PNGs, a sealed baseline made by ``ditq baseline`` in process (2 seeds, 2 steps, 32x48 at most), and a
candidate run made by ``ditq probe`` against a deterministic stub images server on loopback, judged by
``ditq gate`` and ``ditq compare``, and a sweep's two candidates over copies of it (``sweep``: CANDIDATE.json and
its run, each naming its own artifact digest). Each case copies what it needs into its own folder (hard links; every edit
replaces a file, never writes into one), crafts one hostile change, and runs ``python -m ditq.cli ...`` (or its
forked stand-in) with stdin from /dev/null, its working directory inside the case folder and a time limit.

Classification, per case:

- **defect**: code shipped with the model ran (a marker file appeared), a prompt was printed, a Python
  traceback, killed by a signal, still running at the limit, a file written or deleted outside the case's
  output, an invalid verdict.json, exit 0 on bad input (e.g. ``OK`` or ``faster YES`` on forged evidence), or a
  legitimate input refused;
- **weak**: refused, but the message does not name the file, field or id that is wrong; or it took longer than
  ``--slow`` seconds; or bad input accepted where the case says why that does no harm beyond it (a FIFO taken
  as an absent file that may legitimately be absent, a lax type);
- **clean**: refused with a non-zero exit in one line naming what is wrong, in time, nothing written outside
  its output; or, for a legitimate input, it succeeded.

Bad evidence that a command judges rather than refuses (a corrupt image in a run) is clean when what the
command prints or writes says so, weak when it is silent.

The JSON holds every case (id, group, command with paths relative to ``$TMP``, exit code, seconds, the first
line of stderr, the line judged, classification, reason) and the totals overall and per group. Server edges
(Origin, HEAD, strict request types, half-close) are not run here: they need a live server and are covered by
tests/serve; benchmarks/serve_attack.py soaks the server under load.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))  # the tests' shared pieces, when run as a script
from fork_server import ForkServer  # noqa: E402
from harness_kit import mine, write_fixture_set  # noqa: E402
from stub_images_server import StubServer  # noqa: E402

DEMO_MODEL = REPO / "ditq" / "demo" / "model"
EVIL = "open({marker!r}, 'w').write('ran')\n"  # what code shipped with a model would do: leave a mark
MARKER = "RAN"  # the marker file, in the case's folder
PROMPTS = ("[y/N]", "Do you wish to run the custom code")
LOG_PREFIXES = ("INFO ", "DEBUG ", "WARNING ")
SCALE = (
    "transformer_blocks.5.attn.to_k.weight_scale"  # the last block: a check of one layer per shape misses it
)
WEIGHTS = "transformer/diffusion_pytorch_model.safetensors"

# ---------------------------------------------------------------------------------------------------------------
# classification (pure: tests/adversarial/test_classify.py checks it)


@dataclass
class Outcome:
    """What one run of the CLI did."""

    exit_code: int | None  # None: still running at the limit (killed)
    seconds: float
    stdout: str
    stderr: str
    marker: bool = False  # the model's code left its mark
    outside: list[str] = field(default_factory=list)  # files written or deleted outside the case's output
    problem: tuple[str, str] | None = None  # a case's own check: (weak | defect, why)
    files_text: str = ""  # what the command wrote for a person to read (REPORT.md), searched in "judge" cases


def judged_line(command: str, stdout: str, stderr: str) -> str:
    """The line a person reads as the answer: ditq's one-line error, else verify's first FAIL, else the last line
    of stderr that is not a log line, else the last line of stdout."""
    err = [line for line in stderr.splitlines() if line.strip()]
    out = [line for line in stdout.splitlines() if line.strip()]
    for line in err:
        if line.startswith(f"ditq {command}: error:"):
            return line
    for line in out:
        if line.startswith("FAIL"):
            return line
    plain = [line for line in err if not line.startswith(LOG_PREFIXES)]
    return (plain or out or [""])[-1]


def classify(
    command: str,
    expect: str,
    names: tuple[str, ...],
    outcome: Outcome,
    slow_s: float,
    accepted: tuple[str, str] | None = None,
) -> tuple[str, str]:
    """(clean | weak | defect, one-line reason). ``expect``: "refuse" (bad input: a non-zero exit, one line
    naming one of ``names``), "legit" (a legitimate input: exit 0) or "judge" (bad evidence the command judges
    rather than refuses: any exit, but what it prints or writes names one of ``names``). ``accepted``: for bad
    input whose acceptance does no harm beyond it, the (label, why) that exit 0 gets instead of a defect."""
    printed = outcome.stdout + outcome.stderr
    line = judged_line(command, outcome.stdout, outcome.stderr)
    if outcome.marker:
        return "defect", "code shipped with the model ran (marker file written)"
    if any(prompt in printed for prompt in PROMPTS):
        return "defect", "asked a question on the terminal"
    if outcome.exit_code is None:
        return "defect", f"still running after {outcome.seconds:.0f} s (killed)"
    if "Traceback (most recent call last)" in printed:
        last = [x for x in outcome.stderr.splitlines() if x.strip()]
        return "defect", f"traceback: {last[-1] if last else '?'}"
    if outcome.exit_code < 0:
        return "defect", f"killed by signal {-outcome.exit_code}"
    if outcome.outside:
        return "defect", f"touched outside its output: {', '.join(outcome.outside[:3])}"
    if outcome.problem:
        return outcome.problem
    if expect == "judge":
        said = (printed + outcome.files_text).lower()
        named = next((n for n in names if n.lower() in said), None)
        if named is None:
            return "weak", f"judged (exit {outcome.exit_code}) without saying {' or '.join(names)}"
        return "clean", f"judged (exit {outcome.exit_code}), saying {named}"
    if expect == "legit":
        if outcome.exit_code != 0:
            return "defect", f"a legitimate input refused (exit {outcome.exit_code}): {line}"
        if outcome.seconds > slow_s:
            return "weak", f"succeeded, but took {outcome.seconds:.0f} s"
        return "clean", "succeeded"
    if outcome.exit_code == 0:
        if accepted is not None:
            return accepted[0], f"accepted (exit 0): {accepted[1]}"
        return "defect", f"exit 0 on bad input: {line}"
    if not any(name.lower() in line.lower() for name in names):
        return "weak", f"refused (exit {outcome.exit_code}) without naming {' or '.join(names)}"
    if outcome.seconds > slow_s:
        return "weak", f"refused naming it, but took {outcome.seconds:.0f} s"
    return (
        "clean",
        f"refused (exit {outcome.exit_code}) naming {next(n for n in names if n.lower() in line.lower())}",
    )


# ---------------------------------------------------------------------------------------------------------------
# crafting helpers: every edit replaces the file (the case folder's files are hard links to the shared inputs)


def put(path: Path, data: bytes | str) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)
    path.write_bytes(data.encode() if isinstance(data, str) else data)


def linked_copy(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst, symlinks=True, copy_function=os.link)


def materialize(link: Path) -> None:
    """Replace a symlinked folder by a linked copy of what it points at (so its files can be edited)."""
    target = link.resolve()
    link.unlink()
    linked_copy(target, link)


def read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def edit(path: Path, **fields: Any) -> None:
    """Set (or, with None as the value of a key prefixed by 'del_', remove) top-level fields of a JSON object."""
    data = read(path)
    for key, value in fields.items():
        if key.startswith("del_"):
            data.pop(key[4:], None)
        else:
            data[key] = value
    put(path, json.dumps(data, indent=1))


def raw_field(path: Path, key: str, raw: str) -> None:
    """Give ``key`` the literal JSON text ``raw`` (NaN, 5000 digits, deep nesting), its other fields kept."""
    data = read(path)
    data.pop(key, None)
    text = json.dumps(data)
    put(path, text[:-1] + (", " if data else "") + f'"{key}": {raw}' + "}")


def duplicate_key(path: Path, key: str, value: Any) -> None:
    """The object with ``key`` given a second time (with ``value``)."""
    text = json.dumps(read(path))
    put(path, text[:-1] + f', "{key}": {json.dumps(value)}' + "}")


def fifo(path: Path) -> None:
    put(path, b"")
    path.unlink()
    os.mkfifo(path)


def folder(path: Path) -> None:
    put(path, b"")
    path.unlink()
    path.mkdir()


DEEP = "[" * 100_000 + "]" * 100_000
BIG = "9" * 5000


def safetensors_header(path: Path) -> tuple[dict[str, Any], bytes]:
    data = path.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + size]), data[8 + size :]


def write_safetensors(
    path: Path, header: dict[str, Any] | str, body: bytes, length: int | None = None
) -> None:
    raw = (header if isinstance(header, str) else json.dumps(header)).encode()
    put(path, struct.pack("<Q", len(raw) if length is None else length) + raw + body)


def edit_header(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    header, body = safetensors_header(path)
    change(header)
    write_safetensors(path, header, body)


def tensors(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Load every tensor of a safetensors file, let ``change`` edit the dict, save it again (metadata kept)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(path, "pt") as handle:
        metadata = handle.metadata()
    values = load_file(path)
    change(values)
    path.unlink()
    save_file(values, path, metadata=metadata)


def reseal(artifact: Path, *changed: str) -> None:
    """What anyone can do after editing an artifact: new digests for the ``changed`` files in MANIFEST.json (and
    the quantization_config it copies from a changed config), and a new MANIFEST.json.sha256."""
    import hashlib

    manifest = read(artifact / "MANIFEST.json")
    for rel in changed:
        path = artifact / rel
        if path.is_file():
            manifest["files"][rel] = {
                "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                "size": path.stat().st_size,
            }
        else:
            manifest["files"].pop(rel, None)
        component = rel.split("/")[0]
        if rel.endswith("/config.json") and component in manifest["components"] and path.is_file():
            manifest["components"][component]["quantization_config"] = read(path).get("quantization_config")
    put(artifact / "MANIFEST.json", json.dumps(manifest, indent=1))
    reseal_manifest(artifact)


def reseal_manifest(artifact: Path) -> None:
    import hashlib

    digest = hashlib.sha256((artifact / "MANIFEST.json").read_bytes()).hexdigest()
    put(artifact / "MANIFEST.json.sha256", f"{digest}  MANIFEST.json\n")


def evil_code(component: Path, marker: Path, module: str = "evilcode") -> None:
    (component / f"{module}.py").write_text(EVIL.format(marker=str(marker)))


def records(run: Path, change: Callable[[list[dict[str, Any]]], list[str] | None]) -> None:
    """Rewrite records.jsonl: ``change`` edits the parsed lines in place, or returns the raw lines to write."""
    lines = [json.loads(line) for line in (run / "records.jsonl").read_text().splitlines() if line.strip()]
    raw = change(lines)
    put(run / "records.jsonl", "\n".join(raw if raw is not None else [json.dumps(x) for x in lines]) + "\n")


def first_line_raw(run: Path, key: str, raw: str, twice: bool = False) -> list[str]:
    """records.jsonl with the first line's ``key`` given the literal JSON ``raw`` (``twice``: as a second value)."""
    lines = (run / "records.jsonl").read_text().splitlines()
    data = json.loads(lines[0])
    if not twice:
        data.pop(key, None)
    text = json.dumps(data)
    lines[0] = text[:-1] + f', "{key}": {raw}' + "}"
    return lines


def corrupt_png(path: Path) -> None:
    put(path, path.read_bytes()[:60])


# ---------------------------------------------------------------------------------------------------------------
# cases


@dataclass
class Case:
    id: str
    group: str
    base: tuple[str, ...]  # the shared inputs the case gets a copy of: source, artifact, bare, fixtures, runs
    build: Callable[
        [Path, dict[str, Any]], list[str]
    ]  # crafts the input in the case folder; returns the argv
    names: tuple[str, ...] = ()  # what a refusal must name (any one)
    expect: str = "refuse"  # refuse | legit | judge (see classify)
    outputs: tuple[str, ...] = ("out",)  # where in the case folder the command may write
    check: Callable[[Path], tuple[str, str] | None] | None = (
        None  # after the run: (weak | defect, why), or None
    )
    timeout: float = 90.0
    console: bool = False  # run the installed `ditq` script instead of `python -m ditq.cli`
    cwd: str = ""  # the working directory, inside the case folder
    accepted: tuple[str, str] | None = None  # see classify
    env: dict[str, str] = field(default_factory=dict)  # set for the command; "$CASE" is the case folder
    python: str | None = (
        None  # run ``python -c`` this code with the argv instead of the CLI (a user's script)
    )


CASES: list[Case] = []


def case(
    group: str, *base: str, names: tuple[str, ...] = (), **options: Any
) -> Callable[[Callable], Callable]:
    def register(build: Callable[[Path, dict[str, Any]], list[str]]) -> Callable:
        CASES.append(Case(build.__name__.strip("_").replace("_", "-"), group, base, build, names, **options))
        return build

    return register


def gen(d: Path, model: str, *extra: str) -> list[str]:
    return ["generate", str(d / model), "--prompt", "a red circle", "--steps", "1", "--size", "32x32", "--device",
            "cpu", "--out", str(d / "out" / "x.png"), *extra]  # fmt: skip


def quantize(d: Path, *extra: str) -> list[str]:
    return [
        "quantize",
        str(d / "source"),
        str(d / "out" / "artifact"),
        "--scheme",
        "w8a8",
        "--device",
        "cpu",
        *extra,
    ]


def verify(d: Path, model: str = "artifact", *extra: str) -> list[str]:
    return ["verify", str(d / model), *extra]


def probe(d: Path, env: dict[str, Any], fixtures: str = "fixtures/fixtures.json") -> list[str]:
    return ["probe", "--endpoint", env["url"], "--fixtures", str(d / fixtures), "--refs", str(d / "fixtures" / "refs"),
            "--seeds", "1", "--steps", "2", "--out", str(d / "out" / "run"), "--no-progress", "--server-wait", "1"]  # fmt: skip


def report(d: Path, *runs: str, baseline: str = "runs/baseline", extra: tuple[str, ...] = ()) -> list[str]:
    return ["report", *(str(d / r) for r in runs or ("runs/cand",)), "--baseline", str(d / baseline),
            "--out", str(d / "out" / "report"), *extra]  # fmt: skip


def gate(d: Path, run: str = "runs/cand", baseline: bool = False) -> list[str]:
    """Without the baseline the stub's images pass (exit 0), so a changed exit code shows."""
    return ["gate", str(d / run), *(["--baseline", str(d / "runs" / "baseline")] if baseline else [])]


def compare(d: Path, run: str = "runs/cand") -> list[str]:
    return ["compare", str(d / run), "--baseline", str(d / "runs" / "baseline"), "--no-lpips"]


JUDGED = ("out", "runs/cand/gate.json", "runs/cand/compare.json")  # gate and compare write beside the run


def verdict_is_json(d: Path) -> tuple[str, str] | None:
    path = d / "out" / "report" / "verdict.json"
    if not path.exists():
        return None
    try:
        json.loads(path.read_text(), parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    except ValueError as error:
        return "defect", f"verdict.json is not valid JSON ({error})"
    return None


# -- model code: no code from a model directory runs, nothing asks ---------------------------------------------


@case("model_code", "source", names=("transformer/config.json",))
def quantize_auto_map(d: Path, env: dict[str, Any]) -> list[str]:
    edit(d / "source/transformer/config.json", auto_map={"AutoModel": "evilcode.EvilModel"})
    evil_code(d / "source/transformer", d / MARKER)
    return quantize(d)


@case("model_code", "bare", names=("transformer/config.json",))
def verify_bare_auto_map(d: Path, env: dict[str, Any]) -> list[str]:
    edit(d / "bare/transformer/config.json", auto_map={"AutoModel": "evilcode.EvilModel"})
    evil_code(d / "bare/transformer", d / MARKER)
    return verify(d, "bare")


@case("model_code", "source", names=("text_encoder/config.json",))
def generate_auto_map_text_encoder(d: Path, env: dict[str, Any]) -> list[str]:
    edit(d / "source/text_encoder/config.json", auto_map={"AutoModel": "evilcode.EvilModel"})
    evil_code(d / "source/text_encoder", d / MARKER)
    return gen(d, "source")


@case("model_code", "source", names=("model_index.json",))
def quantize_untrusted_library(d: Path, env: dict[str, Any]) -> list[str]:
    edit(d / "source/model_index.json", text_encoder=["evilcode", "EvilModel"])
    evil_code(d / "source", d / MARKER)
    evil_code(d / "source/text_encoder", d / MARKER)
    return quantize(d)


@case("model_code", "artifact", names=("model_index.json",))
def generate_untrusted_library_artifact(d: Path, env: dict[str, Any]) -> list[str]:
    edit(d / "artifact/model_index.json", scheduler=["evilcode", "EvilScheduler"])
    materialize(d / "artifact/scheduler")
    evil_code(d / "artifact/scheduler", d / MARKER)
    return gen(d, "artifact")


@case("model_code", "source", names=("diffusers.py",))
def generate_library_shadow_file(d: Path, env: dict[str, Any]) -> list[str]:
    evil_code(
        d / "source/transformer", d / MARKER, module="diffusers"
    )  # what diffusers would import in its place
    return gen(d, "source")


@case("model_code", "source", names=("model_index.json", "transformer"))
def generate_auto_class(d: Path, env: dict[str, Any]) -> list[str]:
    edit(d / "source/model_index.json", transformer=["transformers", "AutoModel"])
    edit(d / "source/transformer/config.json", model_type="evil")
    return gen(d, "source")


@case("model_code", "source", names=("model_index.json",))
def generate_private_class(d: Path, env: dict[str, Any]) -> list[str]:
    edit(d / "source/model_index.json", scheduler=["diffusers", "__loader__"])
    return gen(d, "source")


@case("model_code", "source", expect="legit", console=True, cwd="source")
def console_script_inside_model_with_torch_py(d: Path, env: dict[str, Any]) -> list[str]:
    # the installed `ditq` script, run from inside a model folder that ships torch.py and diffusers.py
    evil_code(d / "source", d / MARKER, module="torch")
    evil_code(d / "source", d / MARKER, module="diffusers")
    return gen(d, "source")


# -- declared sizes against stored tensors -----------------------------------------------------------------------


@case("declared_sizes", "artifact", names=("transformer/config.json",))
def verify_num_layers_200000(d: Path, env: dict[str, Any]) -> list[str]:
    edit(d / "artifact/transformer/config.json", num_layers=200000)
    reseal(d / "artifact", "transformer/config.json")
    return verify(d)


@case("declared_sizes", "artifact", names=("transformer/config.json",))
def generate_heads_2_20(d: Path, env: dict[str, Any]) -> list[str]:
    edit(d / "artifact/transformer/config.json", num_attention_heads=2**20)
    return gen(d, "artifact")


@case("declared_sizes", "source", names=("transformer/config.json",))
def generate_rope_axes_huge(d: Path, env: dict[str, Any]) -> list[str]:
    edit(d / "source/transformer/config.json", axes_dims_rope=[16777216, 24, 24])
    return gen(d, "source")


@case("declared_sizes", "artifact", names=("transformer/config.json",))
def verify_rope_axes_huge(d: Path, env: dict[str, Any]) -> list[str]:
    edit(d / "artifact/transformer/config.json", axes_dims_rope=[16, 24, 16777216])
    reseal(d / "artifact", "transformer/config.json")
    return verify(d)


@case("declared_sizes", "source", names=("text_encoder/config.json",))
def generate_text_hidden_2_20(d: Path, env: dict[str, Any]) -> list[str]:
    edit(d / "source/text_encoder/config.json", hidden_size=2**20)
    return gen(d, "source")


@case("declared_sizes", "source", names=("transformer/config.json",))
def quantize_negative_layers(d: Path, env: dict[str, Any]) -> list[str]:
    edit(d / "source/transformer/config.json", num_layers=-1)
    return quantize(d)


@case("declared_sizes", "source", names=("transformer/config.json",))
def quantize_head_dim_mismatch(d: Path, env: dict[str, Any]) -> list[str]:
    edit(d / "source/transformer/config.json", attention_head_dim=128)
    return quantize(d)


# -- safetensors headers -----------------------------------------------------------------------------------------


def _first_tensor(header: dict[str, Any]) -> str:
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])[0]


@case("safetensors", "bare", names=("diffusion_pytorch_model.safetensors",))
def verify_bare_float_shape(d: Path, env: dict[str, Any]) -> list[str]:
    def change(h: dict[str, Any]) -> None:
        name = _first_tensor(h)
        h[name]["shape"] = [float(x) for x in h[name]["shape"]]

    edit_header(d / "bare" / WEIGHTS, change)
    return verify(d, "bare")


@case("safetensors", "bare", names=("diffusion_pytorch_model.safetensors",))
def verify_bare_overlapping_offsets(d: Path, env: dict[str, Any]) -> list[str]:
    def change(h: dict[str, Any]) -> None:
        second = sorted((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])[1]
        h[second]["data_offsets"] = [o - 4 for o in h[second]["data_offsets"]]

    edit_header(d / "bare" / WEIGHTS, change)
    return verify(d, "bare")


@case("safetensors", "source", names=("diffusion_pytorch_model.safetensors",))
def generate_offsets_out_of_bounds(d: Path, env: dict[str, Any]) -> list[str]:
    def change(h: dict[str, Any]) -> None:
        last = max((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][1])
        start, end = h[last]["data_offsets"]
        h[last]["data_offsets"] = [start + 2**40, end + 2**40]

    edit_header(d / "source" / WEIGHTS, change)
    return gen(d, "source")


@case("safetensors", "source", names=("diffusion_pytorch_model.safetensors",))
def quantize_header_length_2_62(d: Path, env: dict[str, Any]) -> list[str]:
    header, body = safetensors_header(d / "source" / WEIGHTS)
    write_safetensors(d / "source" / WEIGHTS, header, body, length=2**62)
    return quantize(d)


@case("safetensors", "source", names=("diffusion_pytorch_model.safetensors",))
def quantize_duplicate_tensor_name(d: Path, env: dict[str, Any]) -> list[str]:
    header, body = safetensors_header(d / "source" / WEIGHTS)
    name = _first_tensor(header)
    text = json.dumps(header)
    write_safetensors(
        d / "source" / WEIGHTS, text[:-1] + f", {json.dumps(name)}: {json.dumps(header[name])}}}", body
    )
    return quantize(d)


@case("safetensors", "source", names=("diffusion_pytorch_model.safetensors",))
def generate_truncated_weights(d: Path, env: dict[str, Any]) -> list[str]:
    data = (d / "source" / WEIGHTS).read_bytes()
    put(d / "source" / WEIGHTS, data[: len(data) // 2])
    return gen(d, "source")


@case("safetensors", "bare", names=("diffusion_pytorch_model.safetensors",))
def verify_bare_unknown_dtype(d: Path, env: dict[str, Any]) -> list[str]:
    edit_header(d / "bare" / WEIGHTS, lambda h: h[_first_tensor(h)].update(dtype="F128"))
    return verify(d, "bare")


@case("safetensors", "bare", names=("diffusion_pytorch_model.safetensors", "header"))
def verify_bare_header_not_json(d: Path, env: dict[str, Any]) -> list[str]:
    _, body = safetensors_header(d / "bare" / WEIGHTS)
    write_safetensors(d / "bare" / WEIGHTS, '{"a": [[[[' + " " * 64, body)
    return verify(d, "bare")


# -- JSON files through the one bounded reader ------------------------------------------------------------------

TC = "transformer/config.json"


@case("json", "source", names=(TC,))
def quantize_config_deep(d: Path, env: dict[str, Any]) -> list[str]:
    raw_field(d / "source" / TC, "zz", DEEP)
    return quantize(d)


@case("json", "source", names=(TC,))
def generate_config_5000_digits(d: Path, env: dict[str, Any]) -> list[str]:
    raw_field(d / "source" / TC, "num_layers", BIG)
    return gen(d, "source")


@case("json", "artifact", names=(TC,))
def generate_config_duplicate_key(d: Path, env: dict[str, Any]) -> list[str]:
    duplicate_key(d / "artifact" / TC, "num_layers", 2)
    return gen(d, "artifact")


@case("json", "source", names=(TC, "eps", "NaN"))
def generate_config_nan_eps(d: Path, env: dict[str, Any]) -> list[str]:
    raw_field(d / "source" / TC, "eps", "NaN")
    return gen(d, "source")


@case("json", "source", names=(TC, "stages[1].eps", "nan"))
def generate_config_nan_in_a_listed_object(d: Path, env: dict[str, Any]) -> list[str]:
    raw_field(d / "source" / TC, "stages", '[{"eps": 1e-6}, {"eps": NaN}]')
    return gen(d, "source")


@case("json", "source", names=(TC,))
def generate_config_wrong_type(d: Path, env: dict[str, Any]) -> list[str]:
    edit(d / "source" / TC, num_layers="six")
    return gen(d, "source")


@case("json", "source", names=(TC,))
def quantize_config_fifo(d: Path, env: dict[str, Any]) -> list[str]:
    fifo(d / "source" / TC)
    return quantize(d)


@case("json", "source", names=(TC,))
def generate_config_directory(d: Path, env: dict[str, Any]) -> list[str]:
    folder(d / "source" / TC)
    return gen(d, "source")


@case("json", "bare", names=(TC,))
def verify_bare_config_missing(d: Path, env: dict[str, Any]) -> list[str]:
    (d / "bare" / TC).unlink()
    return verify(d, "bare")


@case("json", "artifact", names=("model_index.json",))
def verify_model_index_deep(d: Path, env: dict[str, Any]) -> list[str]:
    raw_field(d / "artifact/model_index.json", "zz", DEEP)
    reseal(d / "artifact", "model_index.json")
    return verify(d)


@case("json", "artifact", names=("model_index.json",))
def generate_model_index_duplicate_key(d: Path, env: dict[str, Any]) -> list[str]:
    duplicate_key(d / "artifact/model_index.json", "transformer", ["diffusers", "FluxTransformer2DModel"])
    return gen(d, "artifact")


@case("json", "source", names=("model_index.json",))
def quantize_model_index_fifo(d: Path, env: dict[str, Any]) -> list[str]:
    fifo(d / "source/model_index.json")
    return quantize(d)


@case("json", "source", names=("model_index.json",))
def generate_model_index_list(d: Path, env: dict[str, Any]) -> list[str]:
    put(d / "source/model_index.json", "[1, 2, 3]")
    return gen(d, "source")


@case("json", "artifact", names=("MANIFEST.json",))
def verify_manifest_5000_digits(d: Path, env: dict[str, Any]) -> list[str]:
    raw_field(d / "artifact/MANIFEST.json", "schema_version", BIG)
    reseal_manifest(d / "artifact")
    return verify(d)


@case("json", "artifact", names=("MANIFEST.json", "files"))
def verify_manifest_files_wrong_type(d: Path, env: dict[str, Any]) -> list[str]:
    edit(d / "artifact/MANIFEST.json", files=["model_index.json"])
    reseal_manifest(d / "artifact")
    return verify(d)


@case("json", "artifact", names=("MANIFEST.json", "max_rel_l2"))
def verify_manifest_nan_statistic(d: Path, env: dict[str, Any]) -> list[str]:
    manifest = read(d / "artifact/MANIFEST.json")
    value = json.dumps(manifest["statistics"]["max_rel_l2"])
    put(
        d / "artifact/MANIFEST.json",
        json.dumps(manifest).replace(f'"max_rel_l2": {value}', '"max_rel_l2": NaN'),
    )
    reseal_manifest(d / "artifact")
    return verify(d)


@case("json", "artifact", names=("MANIFEST.json",))
def generate_manifest_deep(d: Path, env: dict[str, Any]) -> list[str]:
    raw_field(d / "artifact/MANIFEST.json", "unused", DEEP)
    return gen(d, "artifact")


@case(
    "json",
    "artifact",
    names=("MANIFEST.json",),
    accepted=(
        "weak",
        "a FIFO MANIFEST.json is taken as no manifest (the seal beside it unread): a bare checkpoint",
    ),
)
def verify_manifest_fifo(d: Path, env: dict[str, Any]) -> list[str]:
    fifo(d / "artifact/MANIFEST.json")
    return verify(d)


def _plan(d: Path, change: Callable[[Path], None]) -> list[str]:
    plan = d / "PLAN.json"
    shutil.copyfile(REPO / "ditq/demo/PLAN.json", plan)
    change(plan)
    return [
        "quantize",
        str(d / "source"),
        str(d / "out" / "artifact"),
        "--plan",
        str(plan),
        "--device",
        "cpu",
    ]


@case("json", "source", names=("PLAN.json",))
def quantize_plan_duplicate_layer(d: Path, env: dict[str, Any]) -> list[str]:
    def change(plan: Path) -> None:
        text = plan.read_text()
        put(
            plan,
            text.replace(
                '"transformer_blocks.0.attn.to_q": "w8a8"',
                '"transformer_blocks.0.attn.to_q": "w8a8", "transformer_blocks.0.attn.to_q": "keep"',
                1,
            ),
        )

    return _plan(d, change)


@case("json", "source", names=("PLAN.json",))
def quantize_plan_nan_target(d: Path, env: dict[str, Any]) -> list[str]:
    def change(plan: Path) -> None:
        data = read(plan)
        key = next(k for k, v in data["target"].items() if isinstance(v, float))
        put(plan, json.dumps(data).replace(f'"{key}": {json.dumps(data["target"][key])}', f'"{key}": NaN', 1))

    return _plan(d, change)


@case("json", "source", names=("PLAN.json",))
def quantize_plan_deep(d: Path, env: dict[str, Any]) -> list[str]:
    return _plan(d, lambda plan: raw_field(plan, "zz", DEEP))


@case("json", "source", names=("PLAN.json", "layers"))
def quantize_plan_layers_wrong_type(d: Path, env: dict[str, Any]) -> list[str]:
    return _plan(d, lambda plan: edit(plan, layers=["w8a8"]))


@case("json", "source", names=("PLAN.json",))
def quantize_plan_directory(d: Path, env: dict[str, Any]) -> list[str]:
    return _plan(d, folder)


@case("json", "runs", names=("RUN.json",), outputs=JUDGED)
def gate_run_json_deep(d: Path, env: dict[str, Any]) -> list[str]:
    raw_field(d / "runs/cand/RUN.json", "zz", DEEP)
    return gate(d)


@case("json", "runs", names=("RUN.json",), outputs=JUDGED)
def compare_run_json_5000_digits(d: Path, env: dict[str, Any]) -> list[str]:
    raw_field(d / "runs/cand/RUN.json", "steps", BIG)
    return compare(d)


@case("json", "runs", names=("RUN.json",))
def report_run_json_duplicate_key(d: Path, env: dict[str, Any]) -> list[str]:
    duplicate_key(d / "runs/cand/RUN.json", "steps", 50)
    return report(d)


@case("json", "runs", names=("RUN.json", "seeds"), outputs=JUDGED)
def gate_run_json_wrong_type(d: Path, env: dict[str, Any]) -> list[str]:
    edit(d / "runs/cand/RUN.json", seeds="1-2")
    return gate(d)


@case(
    "json",
    "runs",
    names=("RUN.json",),
    outputs=JUDGED,
    accepted=("weak", "a folder named RUN.json is taken as none, as for a seed-style run without one"),
)
def compare_run_json_directory(d: Path, env: dict[str, Any]) -> list[str]:
    folder(d / "runs/cand/RUN.json")
    return compare(d)


@case(
    "json",
    "runs",
    names=("RUN.json",),
    accepted=("weak", "a FIFO RUN.json is taken as none (not read, no hang), as for a seed-style run"),
)
def report_run_json_fifo(d: Path, env: dict[str, Any]) -> list[str]:
    fifo(d / "runs/cand/RUN.json")
    return report(d)


@case("json", "runs", names=("records.jsonl",), outputs=JUDGED)
def gate_records_5000_digits(d: Path, env: dict[str, Any]) -> list[str]:
    records(d / "runs/cand", lambda _: first_line_raw(d / "runs/cand", "seed", BIG))
    return gate(d)


@case("json", "runs", names=("records.jsonl",), outputs=JUDGED)
def compare_records_duplicate_key(d: Path, env: dict[str, Any]) -> list[str]:
    records(d / "runs/cand", lambda lines: first_line_raw(d / "runs/cand", "wall_s", "0.001", twice=True))
    return compare(d)


@case("json", "runs", names=("records.jsonl",), check=verdict_is_json)
def report_records_deep(d: Path, env: dict[str, Any]) -> list[str]:
    records(d / "runs/cand", lambda _: first_line_raw(d / "runs/cand", "metrics", DEEP))
    return report(d)


@case(
    "json",
    "runs",
    names=("records.jsonl", "http"),
    outputs=JUDGED,
    accepted=("weak", 'http: "200" is read as the number 200 (lax types)'),
)
def gate_records_wrong_type(d: Path, env: dict[str, Any]) -> list[str]:
    records(d / "runs/cand", lambda lines: lines[0].update(http="200"))
    return gate(d)


@case("json", "runs", names=("records.jsonl",), outputs=JUDGED)
def gate_records_fifo(d: Path, env: dict[str, Any]) -> list[str]:
    fifo(d / "runs/cand/records.jsonl")
    return gate(d)


@case("json", "runs", names=("records.jsonl",), outputs=JUDGED)
def compare_records_directory(d: Path, env: dict[str, Any]) -> list[str]:
    folder(d / "runs/cand/records.jsonl")
    return compare(d)


FX = "fixtures/fixtures.json"


@case("json", "fixtures", names=("fixtures.json",))
def probe_fixtures_deep(d: Path, env: dict[str, Any]) -> list[str]:
    raw_field(d / FX, "gen-one", DEEP)
    return probe(d, env)


@case("json", "fixtures", names=("fixtures.json",))
def probe_fixtures_duplicate_id(d: Path, env: dict[str, Any]) -> list[str]:
    duplicate_key(d / FX, "gen-one", read(d / FX)["gen-one"])
    return probe(d, env)


@case("json", "fixtures", names=("fixtures.json", "width"))
def probe_fixtures_width_string(d: Path, env: dict[str, Any]) -> list[str]:
    data = read(d / FX)
    data["gen-one"]["width"] = "32"
    put(d / FX, json.dumps(data))
    return probe(d, env)


@case("json", "fixtures", names=("fixtures.json",))
def probe_fixtures_width_5000_digits(d: Path, env: dict[str, Any]) -> list[str]:
    put(d / FX, (d / FX).read_text().replace('"width": 32', f'"width": {BIG}', 1))
    return probe(d, env)


@case("json", "fixtures", names=("fixtures.json", "width"))
def probe_fixtures_width_nan(d: Path, env: dict[str, Any]) -> list[str]:
    put(d / FX, (d / FX).read_text().replace('"width": 32', '"width": NaN', 1))
    return probe(d, env)


@case("json", "fixtures", names=("fixtures.json",))
def probe_fixtures_fifo(d: Path, env: dict[str, Any]) -> list[str]:
    fifo(d / FX)
    return probe(d, env)


@case("json", "fixtures", names=("missing.json",))
def probe_fixtures_missing(d: Path, env: dict[str, Any]) -> list[str]:
    return probe(d, env, fixtures="fixtures/missing.json")


@case("json", "fixtures", names=("fixtures.json", "height"))
def plan_fixtures_height_negative(d: Path, env: dict[str, Any]) -> list[str]:
    data = read(d / FX)
    data["gen-one"]["height"] = -48
    put(d / FX, json.dumps(data))
    return ["plan", str(DEMO_MODEL), "--out", str(d / "out" / "PLAN.json"), "--fixtures", str(d / FX),
            "--refs", str(d / "fixtures" / "refs"), "--device", "cpu"]  # fmt: skip


# -- re: patterns in quantization_config -------------------------------------------------------------------------


def _ignore(d: Path, model: str, *patterns: str) -> None:
    data = read(d / model / TC)
    data["quantization_config"]["ignore"] = [*data["quantization_config"]["ignore"], *patterns]
    put(d / model / TC, json.dumps(data))


@case("patterns", "artifact", names=(TC,))
def verify_redos_pattern(d: Path, env: dict[str, Any]) -> list[str]:
    _ignore(d, "artifact", "re:(.*)*X")
    reseal(d / "artifact", TC)
    return verify(d)


@case("patterns", "artifact", names=(TC,))
def generate_redos_pattern(d: Path, env: dict[str, Any]) -> list[str]:
    _ignore(d, "artifact", "re:(a|aa)+$")
    return gen(d, "artifact")


@case("patterns", "artifact", names=(TC,))
def verify_invalid_pattern(d: Path, env: dict[str, Any]) -> list[str]:
    _ignore(d, "artifact", "re:(")
    reseal(d / "artifact", TC)
    return verify(d)


@case("patterns", "artifact", names=(TC,))
def generate_backreference_pattern(d: Path, env: dict[str, Any]) -> list[str]:
    _ignore(d, "artifact", r"re:(a)\1")
    return gen(d, "artifact")


@case("patterns", "artifact", names=(TC,))
def generate_40_patterns(d: Path, env: dict[str, Any]) -> list[str]:
    _ignore(d, "artifact", *(f"re:nothing{i}" for i in range(40)))
    return gen(d, "artifact")


@case("patterns", "source", names=("--ignore", "re:(.*)*X"))
def quantize_redos_ignore_argument(d: Path, env: dict[str, Any]) -> list[str]:
    return quantize(d, "--ignore", "re:(.*)*X")


@case("patterns", "source", names=("--targets", "re:["))
def quantize_invalid_targets_argument(d: Path, env: dict[str, Any]) -> list[str]:
    return quantize(d, "--targets", "re:[")


@case("patterns", "source", names=("--ignore", "re:"))
def quantize_long_pattern_argument(d: Path, env: dict[str, Any]) -> list[str]:
    return quantize(d, "--ignore", "re:" + "a?" * 300 + "a" * 300)


# -- scales ------------------------------------------------------------------------------------------------------


def _scale(d: Path, value: float, dtype: Any = None) -> None:
    import torch

    def change(values: dict[str, Any]) -> None:
        scale = torch.full_like(values[SCALE], value)
        values[SCALE] = scale.to(dtype) if dtype is not None else scale

    tensors(d / "artifact" / WEIGHTS, change)


@case("scales", "artifact", names=(SCALE, "safetensors"))
def generate_nan_scale(d: Path, env: dict[str, Any]) -> list[str]:
    _scale(d, float("nan"))
    return gen(d, "artifact")


@case("scales", "artifact", names=(SCALE, "safetensors"))
def generate_inf_scale(d: Path, env: dict[str, Any]) -> list[str]:
    _scale(d, float("inf"))
    return gen(d, "artifact")


@case("scales", "artifact", names=(SCALE, "weight_scale"))
def verify_3e38_scale(d: Path, env: dict[str, Any]) -> list[str]:
    _scale(d, 3e38)
    reseal(d / "artifact", WEIGHTS)
    return verify(d)


@case("scales", "artifact", names=(SCALE, "safetensors"))
def generate_negative_scale(d: Path, env: dict[str, Any]) -> list[str]:
    _scale(d, -0.01)
    return gen(d, "artifact")


@case("scales", "artifact", names=(SCALE, "safetensors"))
def generate_zero_scale(d: Path, env: dict[str, Any]) -> list[str]:
    _scale(d, 0.0)
    return gen(d, "artifact")


@case("scales", "artifact", names=(SCALE, "float64", "safetensors"))
def generate_float64_scale(d: Path, env: dict[str, Any]) -> list[str]:
    import torch

    _scale(d, 0.01, torch.float64)
    return gen(d, "artifact")


@case("scales", "artifact", names=(TC, "quantization_config"))
def generate_quantization_config_null(d: Path, env: dict[str, Any]) -> list[str]:
    edit(d / "artifact" / TC, quantization_config=None)
    return gen(d, "artifact")


@case("scales", "artifact", names=(SCALE, "weight_scale", "transformer_blocks.5"))
def doctor_nan_scale_last_block(d: Path, env: dict[str, Any]) -> list[str]:
    _scale(d, float("nan"))
    return ["doctor", "--artifact", str(d / "artifact"), "--device", "cpu"]


@case("scales", "artifact", names=(SCALE, "safetensors"), timeout=60)
def serve_nan_scale(d: Path, env: dict[str, Any]) -> list[str]:
    _scale(d, float("nan"))
    return ["serve", str(d / "artifact"), "--port", "0", "--device", "cpu", "--dtype", "float32"]


# -- model_index.json entries ------------------------------------------------------------------------------------


@case("model_index", "source", names=("model_index.json",))
def quantize_three_item_entry(d: Path, env: dict[str, Any]) -> list[str]:
    edit(d / "source/model_index.json", transformer=["diffusers", "QwenImage21Transformer2DModel", "x"])
    return quantize(d)


@case("model_index", "artifact", names=("model_index.json",))
def verify_class_with_separator(d: Path, env: dict[str, Any]) -> list[str]:
    edit(d / "artifact/model_index.json", transformer=["diffusers/../x", "QwenImage21Transformer2DModel"])
    reseal(d / "artifact", "model_index.json")
    return verify(d)


@case("model_index", "source", names=("model_index.json", "../"))
def generate_dotdot_key(d: Path, env: dict[str, Any]) -> list[str]:
    edit(d / "source/model_index.json", **{"../text_encoder": ["ditq.demo.text_encoder", "DemoTextEncoder"]})
    return gen(d, "source")


@case("model_index", "source", names=("model_index.json",))
def generate_absolute_key(d: Path, env: dict[str, Any]) -> list[str]:
    edit(
        d / "source/model_index.json",
        **{str(d / "source/text_encoder"): ["ditq.demo.text_encoder", "DemoTextEncoder"]},
    )
    return gen(d, "source")


@case("model_index", "source", names=("model_index.json", "transformer"))
def generate_entry_is_string(d: Path, env: dict[str, Any]) -> list[str]:
    edit(d / "source/model_index.json", transformer="diffusers.QwenImage21Transformer2DModel")
    return gen(d, "source")


@case("model_index", "bare", names=("transformer",))
def verify_bare_component_is_file(d: Path, env: dict[str, Any]) -> list[str]:
    shutil.rmtree(d / "bare/transformer")
    put(d / "bare/transformer", "{}")
    return verify(d, "bare")


@case("verify_tampered", "artifact", "source", names=("text_encoder", "model_index.json"))
def verify_source_text_encoder_removed(d: Path, env: dict[str, Any]) -> list[str]:
    edit(d / "artifact/model_index.json", del_text_encoder=None)
    (d / "artifact/text_encoder").unlink()
    manifest = read(d / "artifact/MANIFEST.json")
    manifest["linked"].pop("text_encoder", None)
    put(d / "artifact/MANIFEST.json", json.dumps(manifest))
    reseal(d / "artifact", "model_index.json")
    return _vsource(d)


@case("model_index", "artifact", "source", expect="legit")
def generate_genuine_artifact(d: Path, env: dict[str, Any]) -> list[str]:
    return gen(d, "artifact")  # with its source beside it: the artifact links to it relatively


# -- paths: fixture ids, reference ids, output folders ----------------------------------------------------------


def _fixture(d: Path, fixture_id: str, references: list[str] | None = None) -> None:
    data = read(d / FX)
    entry = dict(data["edit-one"] if references is not None else data["gen-one"])
    if references is not None:
        entry["references"] = references
    put(d / FX, json.dumps({fixture_id: entry}))


@case("paths", "fixtures", names=("../escaped", "fixture id"))
def probe_fixture_id_dotdot(d: Path, env: dict[str, Any]) -> list[str]:
    _fixture(
        d, "../../../escaped"
    )  # out/run/images/../../../escaped.s1.png: in the case folder, outside out/
    return probe(d, env)


@case("paths", "fixtures", names=("escaped", "fixture id"))
def probe_fixture_id_absolute(d: Path, env: dict[str, Any]) -> list[str]:
    _fixture(d, str(d / "escaped"))
    return probe(d, env)


@case("paths", "fixtures", names=("a/b", "fixture id"))
def probe_fixture_id_separator(d: Path, env: dict[str, Any]) -> list[str]:
    _fixture(d, "a/b")
    return probe(d, env)


@case("paths", "fixtures", names=("..", "fixture id"))
def probe_fixture_id_dotdot_alone(d: Path, env: dict[str, Any]) -> list[str]:
    _fixture(d, "..")
    return probe(d, env)


@case("paths", "fixtures", names=("../secret", "reference"))
def probe_reference_id_dotdot(d: Path, env: dict[str, Any]) -> list[str]:
    shutil.copyfile(d / "fixtures/refs/ref-a.png", d / "fixtures/secret.png")
    _fixture(d, "edit-x", ["../secret"])
    return probe(d, env)


@case("paths", "fixtures", names=("secret", "reference"))
def probe_reference_id_absolute(d: Path, env: dict[str, Any]) -> list[str]:
    shutil.copyfile(d / "fixtures/refs/ref-a.png", d / "secret.png")
    _fixture(d, "edit-x", [str(d / "secret")])
    return probe(d, env)


@case("paths", "fixtures", names=("../escaped", "fixture id"))
def baseline_fixture_id_dotdot(d: Path, env: dict[str, Any]) -> list[str]:
    _fixture(d, "../../../escaped")
    return ["baseline", str(DEMO_MODEL), "--fixtures", str(d / FX), "--refs", str(d / "fixtures/refs"), "--seeds",
            "1", "--steps", "1", "--device", "cpu", "--out", str(d / "out" / "run"), "--no-progress"]  # fmt: skip


@case("paths", "runs", names=("baseline", "--out"))
def report_out_is_the_baseline(d: Path, env: dict[str, Any]) -> list[str]:
    argv = report(d)
    argv[argv.index("--out") + 1] = str(d / "runs/baseline")
    return argv


def _notes_kept(d: Path) -> tuple[str, str] | None:
    if (d / "out/report/notes.txt").exists():
        return None
    return "weak", "deleted notes.txt, a file it did not write, in --out (documented: 'replaced as a whole')"


@case("paths", "runs", names=("--out", "notes.txt", "not a report"), check=_notes_kept)
def report_out_holds_other_files(d: Path, env: dict[str, Any]) -> list[str]:
    (d / "out" / "report").mkdir(parents=True)
    (d / "out" / "report" / "notes.txt").write_text("a person's notes")
    return report(d)


# -- forged evidence ---------------------------------------------------------------------------------------------


def _slower(lines: list[dict[str, Any]]) -> None:
    for line in lines:
        line["wall_s"] = (line.get("wall_s") or 1.0) * 50


@case("evidence", "runs", names=("SEAL", "seal", "sealed"))
def report_baseline_records_edited(d: Path, env: dict[str, Any]) -> list[str]:
    records(d / "runs/baseline", _slower)
    return report(d)


@case("evidence", "runs", names=("SEAL", "seal", "sealed"), outputs=JUDGED)
def gate_baseline_records_edited(d: Path, env: dict[str, Any]) -> list[str]:
    records(d / "runs/baseline", _slower)
    return gate(d, baseline=True)


@case("evidence", "runs", names=("SEAL", "seal", "sealed"), outputs=JUDGED)
def compare_baseline_images_swapped(d: Path, env: dict[str, Any]) -> list[str]:
    images = sorted((d / "runs/baseline/images").iterdir())
    first, second = images[0].read_bytes(), images[1].read_bytes()
    put(images[0], second)
    put(images[1], first)
    return compare(d)


@case("evidence", "runs", names=("SEAL", "seal", "sealed"))
def report_baseline_seal_removed(d: Path, env: dict[str, Any]) -> list[str]:
    (d / "runs/baseline/SEAL.json").unlink()
    return report(d)


@case("evidence", "runs", names=("records.jsonl", "wall_s"), check=verdict_is_json)
def report_negative_wall(d: Path, env: dict[str, Any]) -> list[str]:
    records(d / "runs/cand", lambda lines: [line.update(wall_s=-5.0) for line in lines] and None)
    return report(d)


@case("evidence", "runs", names=("records.jsonl", "wall_s"), check=verdict_is_json)
def report_nan_wall(d: Path, env: dict[str, Any]) -> list[str]:
    records(d / "runs/cand", lambda _: first_line_raw(d / "runs/cand", "wall_s", "NaN"))
    return report(d)


@case("evidence", "runs", names=("records.jsonl", "wall_s"), outputs=JUDGED)
def gate_infinite_wall(d: Path, env: dict[str, Any]) -> list[str]:
    records(d / "runs/cand", lambda _: first_line_raw(d / "runs/cand", "wall_s", "Infinity"))
    return gate(d)


@case("evidence", "runs", names=("records.jsonl", "peak_memory_mib"), check=verdict_is_json)
def report_negative_memory(d: Path, env: dict[str, Any]) -> list[str]:
    records(d / "runs/cand", lambda lines: [line.update(peak_memory_mib=-1e6) for line in lines] and None)
    return report(d)


# what a command judging an image it cannot read must say (any one)
UNREADABLE = ("cannot be decoded", "cannot be read", "corrupt", "truncated")


def _corrupt_first(run: Path) -> None:
    corrupt_png(sorted((run / "images").iterdir())[0])


@case("evidence", "runs", names=UNREADABLE, expect="judge")
def report_corrupt_candidate_image(d: Path, env: dict[str, Any]) -> list[str]:
    _corrupt_first(d / "runs/cand")
    return report(d)


@case(
    "evidence",
    "runs",
    names=UNREADABLE,
    expect="judge",
    outputs=JUDGED,
)
def compare_corrupt_candidate_image(d: Path, env: dict[str, Any]) -> list[str]:
    _corrupt_first(d / "runs/cand")
    return compare(d)


@case("evidence", "runs", names=UNREADABLE, expect="judge")
def report_corrupt_baseline_image_resealed(d: Path, env: dict[str, Any]) -> list[str]:
    from ditq.judge.baseline import seal_run

    _corrupt_first(d / "runs/baseline")
    (d / "runs/baseline/SEAL.json").unlink()
    seal_run(d / "runs/baseline")
    return report(d)


@case(
    "evidence",
    "runs",
    names=UNREADABLE,
    expect="judge",
    outputs=JUDGED,
)
def gate_corrupt_baseline_image_unsealed(d: Path, env: dict[str, Any]) -> list[str]:
    _corrupt_first(d / "runs/baseline")
    return [*gate(d, baseline=True), "--allow-unsealed"]


@case("evidence", "runs", names=("sha256", "does not match"), expect="judge", outputs=JUDGED)
def gate_candidate_image_swapped(d: Path, env: dict[str, Any]) -> list[str]:
    images = sorted((d / "runs/cand/images").iterdir())
    put(
        images[0], (d / "runs/baseline/images" / images[0].name).read_bytes()
    )  # the baseline's picture, claimed
    return gate(d)


@case("evidence", "runs", names=("FAIL", "failed", "no image"), outputs=JUDGED)
def gate_every_request_401(d: Path, env: dict[str, Any]) -> list[str]:
    def change(lines: list[dict[str, Any]]) -> None:
        for line in lines:
            line.update(http=401, bytes=None, sha256=None, structure=None, error="HTTP 401 unauthorized")

    records(d / "runs/cand", change)
    shutil.rmtree(d / "runs/cand/images")
    (d / "runs/cand/images").mkdir()
    return gate(d)


def _collapse_reported(d: Path) -> tuple[str, str] | None:
    written = d / "out/report/REPORT.md"
    if not written.is_file() or "structure gate failed" in read_text(written):
        return None  # refused (what it printed must name gate.json) or the drift reported
    return "defect", "believed a gate.json edited to PASS: the drift its images show is no longer reported"


@case(
    "evidence", "runs", names=("structure gate failed", "gate.json"), expect="judge", check=_collapse_reported
)
def report_gate_json_forged_pass(d: Path, env: dict[str, Any]) -> list[str]:
    # the candidate's own files are not sealed; gate.json is what `ditq gate` concluded from its images
    gate_file = read(d / "runs/cand/gate.json")
    gate_file.update(verdict="PASS", passes=gate_file["n"])
    for line in gate_file["records"]:
        line.update(passed=True, reasons=[])
    for group in gate_file["by_references"].values():
        group["passes"] = group["n"]
    put(d / "runs/cand/gate.json", json.dumps(gate_file))
    return report(d)


@case("evidence", "runs", expect="legit", check=verdict_is_json)
def report_genuine_runs(d: Path, env: dict[str, Any]) -> list[str]:
    return report(d)


@case("evidence", "runs", expect="legit", outputs=JUDGED)
def gate_genuine_run_exit(d: Path, env: dict[str, Any]) -> list[str]:
    return gate(d)  # without a baseline: the collapse signatures only, which the stub's images pass


# -- verify on tampered artifacts, re-sealed -------------------------------------------------------------------


def _vsource(d: Path) -> list[str]:
    # the source the artifact's links lead to: the shared one ($TMP/shared/source), which no case edits
    return ["verify", str(d / "artifact"), "--source", str(d.parent.parent / "shared" / "source")]


@case("verify_tampered", "artifact", "source", names=(TC,))
def verify_source_changed_config(d: Path, env: dict[str, Any]) -> list[str]:
    edit(d / "artifact" / TC, eps=0.1)
    reseal(d / "artifact", TC)
    return _vsource(d)


@case("verify_tampered", "artifact", "source", names=("text_encoder",))
def verify_source_relinked_zeroed_text_encoder(d: Path, env: dict[str, Any]) -> list[str]:
    import torch

    other = d / "other_text_encoder"
    linked_copy(d / "source/text_encoder", other)
    tensors(
        other / "diffusion_pytorch_model.safetensors",
        lambda v: v.update({k: torch.zeros_like(t) for k, t in v.items()}),
    )
    (d / "artifact/text_encoder").unlink()
    (d / "artifact/text_encoder").symlink_to(other)
    manifest = read(d / "artifact/MANIFEST.json")
    manifest["linked"]["text_encoder"] = str(other)
    put(d / "artifact/MANIFEST.json", json.dumps(manifest))
    reseal_manifest(d / "artifact")
    return _vsource(d)


@case("verify_tampered", "artifact", "source", names=("scheduler",))
def verify_source_scheduler_shift_7(d: Path, env: dict[str, Any]) -> list[str]:
    materialize(d / "artifact/scheduler")
    edit(d / "artifact/scheduler/scheduler_config.json", shift=7.0)
    manifest = read(d / "artifact/MANIFEST.json")
    manifest["linked"].pop("scheduler")
    put(d / "artifact/MANIFEST.json", json.dumps(manifest))
    reseal(d / "artifact", "scheduler/scheduler_config.json")
    return _vsource(d)


@case("verify_tampered", "artifact", "source", names=("model_index.json",))
def verify_source_model_index_edited(d: Path, env: dict[str, Any]) -> list[str]:
    edit(d / "artifact/model_index.json", default_guidance_scale=9.0)
    reseal(d / "artifact", "model_index.json")
    return _vsource(d)


@case("verify_tampered", "artifact", names=("unknown", "extra", "zz_extra"))
def verify_extra_tensor(d: Path, env: dict[str, Any]) -> list[str]:
    import torch

    tensors(d / "artifact" / WEIGHTS, lambda v: v.update(zz_extra=torch.zeros(4)))
    reseal(d / "artifact", WEIGHTS)
    return verify(d)


@case("verify_tampered", "artifact", names=("img_in.weight", "shape"))
def verify_kept_tensor_wrong_shape(d: Path, env: dict[str, Any]) -> list[str]:
    tensors(
        d / "artifact" / WEIGHTS,
        lambda v: v.update({"img_in.weight": v["img_in.weight"][:, :32].contiguous()}),
    )
    reseal(d / "artifact", WEIGHTS)
    return verify(d)


@case("verify_tampered", "artifact", names=("input_scale",))
def verify_extra_input_scale(d: Path, env: dict[str, Any]) -> list[str]:
    import torch

    name = SCALE.replace("weight_scale", "input_scale")
    tensors(d / "artifact" / WEIGHTS, lambda v: v.update({name: torch.ones(1)}))
    reseal(d / "artifact", WEIGHTS)
    return verify(d)


@case("verify_tampered", "artifact", names=("transformer/config.json",))
def verify_config_edited_not_resealed(d: Path, env: dict[str, Any]) -> list[str]:
    edit(d / "artifact" / TC, num_layers=5)
    return verify(d)


@case("verify_tampered", "artifact", "source", expect="legit")
def verify_source_genuine(d: Path, env: dict[str, Any]) -> list[str]:
    return _vsource(d)


# -- issue 48: one rule for replacing an output ------------------------------------------------------------------
# Each case's output is a folder of the person's own (or an input): nothing in it may be deleted or changed, so the
# case's outputs are none but "out" (which none of these writes into).


def pictures(
    folder: Path, picture: bytes | None = None, prompts: str = "one [p]: the picture, but blue\n"
) -> Path:
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    if picture is None:
        Image.new("RGB", (16, 16), "red").save(folder / "p.png")
    else:
        (folder / "p.png").write_bytes(picture)
    (folder / "prompts.txt").write_text(prompts)
    return folder


def fixtures_init(folder: Path, *extra: str) -> list[str]:
    return ["fixtures", "init", str(folder), "--size", "32x32", *extra]


@case("outputs", "source", names=("existing", "ditq wrote"))
def quantize_force_into_a_folder_of_other_files(d: Path, env: dict[str, Any]) -> list[str]:
    out = mine(d / "existing")
    return ["quantize", str(d / "source"), str(out), "--scheme", "w8a8", "--device", "cpu", "--force"]


@case("outputs", "source", names=("current directory",), cwd="here")
def quantize_force_into_the_current_directory(d: Path, env: dict[str, Any]) -> list[str]:
    mine(d / "here")
    return ["quantize", str(d / "source"), ".", "--scheme", "w8a8", "--device", "cpu", "--force"]


@case("outputs", "source", names=("home folder",), env={"HOME": "$CASE/home"})
def quantize_force_into_home(d: Path, env: dict[str, Any]) -> list[str]:
    home = mine(d / "home")
    (home / "MANIFEST.json").write_text("{}")  # even with ditq's marker: the home folder is never replaced
    return ["quantize", str(d / "source"), str(home), "--scheme", "w8a8", "--device", "cpu", "--force"]


@case("outputs", names=("pics", "the output"))
def fixtures_init_out_is_its_own_folder(d: Path, env: dict[str, Any]) -> list[str]:
    return fixtures_init(pictures(d / "pics"), "--out", str(d / "pics"), "--force")


@case("outputs", names=("parent", "the output"))
def fixtures_init_out_holds_its_pictures(d: Path, env: dict[str, Any]) -> list[str]:
    parent = mine(d / "parent")
    pictures(parent / "pics")
    return fixtures_init(parent / "pics", "--out", str(parent), "--force")


def _nothing_half_made(d: Path) -> tuple[str, str] | None:
    if (d / "new").exists():
        return "defect", "a failed fixtures init left new/ behind"
    return None


@case("outputs", names=("p.png",), check=_nothing_half_made)
def fixtures_init_failed_leaves_nothing(d: Path, env: dict[str, Any]) -> list[str]:
    return fixtures_init(pictures(d / "pics", b"not a picture"), "--out", str(d / "new" / "sub" / "fixtures"))


@case("outputs", "fixtures", names=("mine", "run directory ditq wrote"))
def probe_out_a_folder_of_other_files(d: Path, env: dict[str, Any]) -> list[str]:
    argv = probe(d, env)
    argv[argv.index("--out") + 1] = str(mine(d / "mine"))
    return argv


# -- issue 48: confined hub resolution ----------------------------------------------------------------------------

HUB_ENV = {"HF_HOME": "$CASE/hf", "HF_HUB_CACHE": "$CASE/hf/hub"}
COMMIT, OTHER = "0123456789abcdef0123456789abcdef01234567", "fedcba9876543210fedcba9876543210fedcba98"


def hub_entry(d: Path, repo: str, commit: str | None = None) -> Path:
    """The cache entry of ``repo`` under $CASE/hf/hub; with ``commit``, the demo model as its snapshot."""
    entry = d / "hf" / "hub" / f"models--{repo.replace('/', '--')}"
    (entry / "refs").mkdir(parents=True)
    (entry / "snapshots").mkdir()
    if commit is not None:
        linked_copy(d / "source", entry / "snapshots" / commit)
        (entry / "refs" / "main").write_text(commit)
    return entry


def hub_quantize(d: Path, spec: str) -> list[str]:
    return ["quantize", spec, str(d / "out" / "artifact"), "--scheme", "w8a8", "--device", "cpu"]


@case("hub", "source", names=("evil/spoof", "refs/main"), env=HUB_ENV)
def hub_ref_out_of_the_cache(d: Path, env: dict[str, Any]) -> list[str]:
    linked_copy(d / "source", d / "outside-model")
    (hub_entry(d, "evil/spoof") / "refs" / "main").write_text("../../../outside-model")
    return hub_quantize(d, "evil/spoof")


@case("hub", "source", names=("evil/spoof", "refs/main"), env=HUB_ENV)
def hub_ref_to_another_repository(d: Path, env: dict[str, Any]) -> list[str]:
    hub_entry(d, "Qwen/Qwen-Image", COMMIT)
    (hub_entry(d, "evil/spoof") / "refs" / "main").write_text(
        f"../../models--Qwen--Qwen-Image/snapshots/{COMMIT}"
    )
    return hub_quantize(d, "evil/spoof")


@case("hub", "source", names=("evil/spoof", "snapshot"), env=HUB_ENV)
def hub_snapshot_linked_to_another_repository(d: Path, env: dict[str, Any]) -> list[str]:
    qwen = hub_entry(d, "Qwen/Qwen-Image", COMMIT)
    spoof = hub_entry(d, "evil/spoof")
    (spoof / "refs" / "main").write_text(OTHER)
    (spoof / "snapshots" / OTHER).symlink_to(qwen / "snapshots" / COMMIT)
    return hub_quantize(d, "evil/spoof")


@case("hub", names=("evil/spoof", "FIFO"), env=HUB_ENV, timeout=30)
def hub_ref_fifo(d: Path, env: dict[str, Any]) -> list[str]:
    os.mkfifo(hub_entry(d, "evil/spoof") / "refs" / "main")
    return hub_quantize(d, "evil/spoof")


@case("hub", names=("evil/spoof", "refs/main"), env=HUB_ENV)
def hub_ref_of_64_mib(d: Path, env: dict[str, Any]) -> list[str]:
    (hub_entry(d, "evil/spoof") / "refs" / "main").write_bytes(b"a" * (64 << 20))
    return hub_quantize(d, "evil/spoof")


@case("hub", names=("good/demo.", "hub id"), env=HUB_ENV)
def hub_id_with_a_trailing_dot(d: Path, env: dict[str, Any]) -> list[str]:
    return hub_quantize(d, "good/demo.")


@case("hub", names=("good/demo-", "hub id"), env=HUB_ENV)
def hub_id_with_a_trailing_dash(d: Path, env: dict[str, Any]) -> list[str]:
    return hub_quantize(d, "good/demo-")


def _provenance_is_the_id_asked(d: Path) -> tuple[str, str] | None:
    manifest = d / "out" / "artifact" / "MANIFEST.json"
    if not manifest.is_file():
        return None
    inputs = read(manifest)["inputs"]
    if (inputs.get("hub_id"), inputs.get("commit")) != ("acme/demo", COMMIT):
        return "defect", f"the manifest records {inputs.get('hub_id')} at {inputs.get('commit')}"
    return None


@case("hub", "source", expect="legit", env=HUB_ENV, check=_provenance_is_the_id_asked)
def hub_genuine_cache_entry(d: Path, env: dict[str, Any]) -> list[str]:
    hub_entry(d, "acme/demo", COMMIT)
    return hub_quantize(d, "acme/demo")


# -- issue 48: what loads is what is sealed -------------------------------------------------------------------------

SEAL_KEY = "DITQ_SEAL_KEY"
KEY = "correct horse battery staple"
KEYED = {SEAL_KEY: KEY}
TE = "text_encoder"


def stray_index_and_shard(d: Path) -> None:
    """A keyed --copy artifact's text encoder given a linked index and a linked shard out of the artifact."""
    other = d / "attacker"
    linked_copy(d / "keyed" / TE, other)
    shard = next(p for p in other.iterdir() if p.name.endswith(".safetensors"))
    (other / "index.json").write_text(json.dumps({"weight_map": {"x": "evil.safetensors"}}))
    (d / "keyed" / TE / "diffusion_pytorch_model.safetensors.index.json").symlink_to(other / "index.json")
    (d / "keyed" / TE / "evil.safetensors").symlink_to(shard)


@case("seal", "keyed", names=("a link the manifest does not record",), env=KEYED)
def verify_keyed_stray_linked_index(d: Path, env: dict[str, Any]) -> list[str]:
    stray_index_and_shard(d)
    return verify(d, "keyed")


@case("seal", "keyed", names=("a link the manifest does not record",))
def verify_unkeyed_stray_linked_index(d: Path, env: dict[str, Any]) -> list[str]:
    stray_index_and_shard(d)
    return verify(d, "keyed")


@case("seal", "keyed", names=("a link the manifest does not record",))
def generate_stray_linked_index(d: Path, env: dict[str, Any]) -> list[str]:
    stray_index_and_shard(d)
    return gen(d, "keyed")


@case("seal", "keyed", names=("extra text_encoder",), env=KEYED)
def verify_keyed_unlisted_shard(d: Path, env: dict[str, Any]) -> list[str]:
    shard = next(p for p in (d / "keyed" / TE).iterdir() if p.name.endswith(".safetensors"))
    shutil.copy(shard, d / "keyed" / TE / "model-00001-of-00001.safetensors")
    return verify(d, "keyed")


def triple_scales(d: Path) -> None:
    tensors(
        d / "keyed" / WEIGHTS,
        lambda v: v.update({k: t * 3 for k, t in v.items() if k.endswith("weight_scale")}),
    )


@case("seal", "keyed", names=("MANIFEST.json",), env=KEYED)
def verify_keyed_manifest_removed_scales_tripled(d: Path, env: dict[str, Any]) -> list[str]:
    for name in ("MANIFEST.json", "MANIFEST.json.hmac", "MANIFEST.json.sha256"):
        (d / "keyed" / name).unlink()
    triple_scales(d)
    return verify(d, "keyed")


@case("seal", "keyed", names=("MANIFEST.json",), env=KEYED)
def verify_keyed_manifest_fifo_scales_tripled(d: Path, env: dict[str, Any]) -> list[str]:
    fifo(d / "keyed" / "MANIFEST.json")
    (d / "keyed" / "MANIFEST.json.hmac").unlink()
    triple_scales(d)
    return verify(d, "keyed")


@case("seal", "keyed", names=("MANIFEST.json",), env=KEYED)
def verify_keyed_manifest_folder_scales_tripled(d: Path, env: dict[str, Any]) -> list[str]:
    folder(d / "keyed" / "MANIFEST.json")
    triple_scales(d)
    return verify(d, "keyed")


NOT_UTF8 = {SEAL_KEY: os.fsdecode(b"\xff\xfe not text \x80")}


@case("seal", "source", expect="legit", env=NOT_UTF8)
def quantize_with_a_key_that_is_not_utf8(d: Path, env: dict[str, Any]) -> list[str]:
    return quantize(d)


# -- issue 48: the diffusers backend refuses as the loader does ---------------------------------------------------

DIFFUSERS = """import sys
import ditq.diffusers
from diffusers import DiffusionPipeline
from ditq.errors import DitqError
try:
    DiffusionPipeline.from_pretrained(sys.argv[2])
except DitqError as error:
    print(f"ditq diffusers: error: {error}", file=sys.stderr)
    raise SystemExit(2)
"""


def diffusers_load(d: Path, model: str) -> list[str]:
    """A person's script: ``DiffusionPipeline.from_pretrained(MODEL)`` after ``import ditq.diffusers``, a ditq error
    printed as the CLI prints one (argv[0], "diffusers", names it for the judged line)."""
    return ["diffusers", str(d / model)]


def qconfig(d: Path, value: Callable[[dict[str, Any]], Any]) -> None:
    data = read(d / "keyed" / TC)
    data["quantization_config"] = value(data["quantization_config"])
    put(d / "keyed" / TC, json.dumps(data))  # not resealed: loading reads names, not digests


@case("diffusers", "keyed", expect="legit", python=DIFFUSERS)
def diffusers_genuine_artifact(d: Path, env: dict[str, Any]) -> list[str]:
    return diffusers_load(d, "keyed")


@case("diffusers", "keyed", names=(TC,), python=DIFFUSERS)
def diffusers_quant_method_capitalized(d: Path, env: dict[str, Any]) -> list[str]:
    qconfig(d, lambda q: {**q, "quant_method": "Compressed-Tensors"})
    return diffusers_load(d, "keyed")


@case("diffusers", "keyed", names=(TC,), python=DIFFUSERS)
def diffusers_quantization_config_a_list(d: Path, env: dict[str, Any]) -> list[str]:
    qconfig(d, lambda q: [q])
    return diffusers_load(d, "keyed")


@case("diffusers", "keyed", names=(TC,), python=DIFFUSERS)
def diffusers_config_wrapped_for_another_component(d: Path, env: dict[str, Any]) -> list[str]:
    qconfig(d, lambda q: {TE: q})
    return diffusers_load(d, "keyed")


@case("diffusers", "keyed", names=(TC, "repeats"), python=DIFFUSERS)
def diffusers_duplicate_config_group(d: Path, env: dict[str, Any]) -> list[str]:
    def twice(q: dict[str, Any]) -> dict[str, Any]:
        q["config_groups"]["group_1"] = q["config_groups"]["group_0"]
        return q

    qconfig(d, twice)
    return diffusers_load(d, "keyed")


@case("diffusers", "keyed", names=("a link the manifest does not record",), python=DIFFUSERS)
def diffusers_stray_linked_index(d: Path, env: dict[str, Any]) -> list[str]:
    stray_index_and_shard(d)
    return diffusers_load(d, "keyed")


# -- issue 48: pictures and text from users ---------------------------------------------------------------------


def png_bomb(width: int, height: int, rows: bool) -> bytes:
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    head = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0))
    body = b""
    if rows:
        packer, row = zlib.compressobj(9), b"\x00" * (1 + (width + 7) // 8)
        body = chunk(b"IDAT", b"".join(packer.compress(row) for _ in range(height)) + packer.flush())
    return head + body + chunk(b"IEND", b"")


EPS = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nnewpath 0 0 moveto 10 10 lineto stroke\nshowpage\n"


@case("pictures", names=("p.png",))
def fixtures_init_png_of_30000_squared(d: Path, env: dict[str, Any]) -> list[str]:
    return fixtures_init(
        pictures(d / "pics", png_bomb(30000, 30000, rows=True)), "--out", str(d / "out" / "fx")
    )


@case("pictures", names=("p.png",))
def fixtures_init_header_of_20000_squared(d: Path, env: dict[str, Any]) -> list[str]:
    return fixtures_init(
        pictures(d / "pics", png_bomb(20000, 20000, rows=False)), "--out", str(d / "out" / "fx")
    )


@case("pictures", names=("p.png",))
def fixtures_init_eps_named_png(d: Path, env: dict[str, Any]) -> list[str]:
    return fixtures_init(pictures(d / "pics", EPS), "--out", str(d / "out" / "fx"))


@case("pictures", names=("prompts.txt",), timeout=30)
def fixtures_init_prompts_fifo(d: Path, env: dict[str, Any]) -> list[str]:
    folder = pictures(d / "pics")
    fifo(folder / "prompts.txt")
    return fixtures_init(folder, "--out", str(d / "out" / "fx"))


@case("pictures", names=("/dev/zero",), timeout=30)
def fixtures_init_prompts_dev_zero(d: Path, env: dict[str, Any]) -> list[str]:
    return fixtures_init(pictures(d / "pics"), "--prompts", "/dev/zero", "--out", str(d / "out" / "fx"))


@case("pictures", expect="legit")
def fixtures_init_prompts_with_a_byte_order_mark(d: Path, env: dict[str, Any]) -> list[str]:
    folder = pictures(d / "pics")
    put(folder / "prompts.txt", "\ufeffone [p]: the picture, but blue\n".encode())
    return fixtures_init(folder, "--out", str(d / "out" / "fx"))


# -- issue 48: evidence chained, not believed ---------------------------------------------------------------------
# A sweep's two candidates (shared "sweep"): each CANDIDATE.json names its artifact's digest and its run's servers
# said they served it; the runs are the stub's (runs/cand), judged against runs/baseline.

DIGESTS = {"w8a8": "ab" * 32, "fp8": "cd" * 32}


def build_sweep(shared: Path) -> None:
    for name, digest in DIGESTS.items():
        run = shared / "sweep" / name / "run"
        linked_copy(shared / "runs" / "cand", run)
        document = read(run / "RUN.json")
        for invocation in document["invocations"]:
            for server in invocation["servers"]:
                server["health"] = {**(server.get("health") or {}), "artifact_digest": digest}
        put(run / "RUN.json", json.dumps(document, indent=1))
        stages = {"probe": {"status": "ok"}, "gate": {"status": "ok"}, "compare": {"status": "ok"}}
        candidate = {"name": name, "scheme": name, "artifact_digest": digest, "stages": stages}
        (shared / "sweep" / name / "CANDIDATE.json").write_text(json.dumps(candidate))


def sweep_report(d: Path, note: str | None = None) -> list[str]:
    runs = [str(d / "sweep" / name) for name in DIGESTS]
    return ["report", *runs, "--baseline", str(d / "runs/baseline"), "--out", str(d / "out" / "report"),
            *(["--note", note] if note else [])]  # fmt: skip


@case("evidence", "runs", "sweep", expect="legit", check=verdict_is_json)
def report_genuine_sweep(d: Path, env: dict[str, Any]) -> list[str]:
    return sweep_report(d)


@case("evidence", "runs", "sweep", names=("compare.json",))
def report_compare_forged_inside_psnr_99(d: Path, env: dict[str, Any]) -> list[str]:
    path = d / "sweep/fp8/run/compare.json"
    data = read(path)
    for row in data["rows"]:
        row.update(status="ok", psnr_db=99.0, ssim=1.0, error=None)
    data["lossless"].update(inside=True, decision="inside")
    put(path, json.dumps(data))
    return sweep_report(d)


@case("evidence", "runs", "sweep", names=("RUN.json", "not this candidate's"))
def report_run_of_another_candidate(d: Path, env: dict[str, Any]) -> list[str]:
    shutil.rmtree(d / "sweep/fp8/run")
    linked_copy(d / "sweep/w8a8/run", d / "sweep/fp8/run")
    return sweep_report(d)


@case("evidence", "runs", "sweep", names=("CANDIDATE.json",))
def report_run_pointer_to_a_sibling(d: Path, env: dict[str, Any]) -> list[str]:
    edit(d / "sweep/fp8/CANDIDATE.json", run="../w8a8/run")
    return sweep_report(d)


@case("evidence", "runs", "sweep", names=("CANDIDATE.json",))
def report_run_pointer_to_etc(d: Path, env: dict[str, Any]) -> list[str]:
    edit(d / "sweep/fp8/CANDIDATE.json", run="/etc")
    return sweep_report(d)


@case("evidence", "runs", "sweep", names=("RUN.json", "seeds"))
def report_seed_listed_twice(d: Path, env: dict[str, Any]) -> list[str]:
    path = d / "sweep/w8a8/run/RUN.json"
    seeds = read(path)["seeds"]
    edit(path, seeds=[*seeds, seeds[0]])
    return sweep_report(d)


@case("evidence", "runs", names=("RUN.json", "fixture_digest"), outputs=JUDGED)
def compare_fixture_digest_zeroed(d: Path, env: dict[str, Any]) -> list[str]:
    edit(d / "runs/cand/RUN.json", fixture_digest="0" * 64)
    return compare(d)


@case("evidence", "runs", "sweep", names=("records.jsonl", "wall_s"))
def report_wall_forged_inside_its_window(d: Path, env: dict[str, Any]) -> list[str]:
    def forged(lines: list[dict[str, Any]]) -> None:  # a 2.5 s request's window, its wall_s made 0.001 s
        for line in lines:
            line.update(t_end=line["t_start"] + 2.5, wall_s=0.001)

    records(d / "sweep/w8a8/run", forged)
    return sweep_report(d)


@case("evidence", "runs", names=("byte for byte",), expect="judge", outputs=JUDGED)
def compare_candidate_holds_the_baseline_images(d: Path, env: dict[str, Any]) -> list[str]:
    base = {
        (r["fixture_id"], r["seed"]): r for r in map(json.loads, (d / "runs/baseline/records.jsonl").open())
    }
    for image in (d / "runs/cand/images").iterdir():
        if (d / "runs/baseline/images" / image.name).is_file():
            put(image, (d / "runs/baseline/images" / image.name).read_bytes())

    def copied(lines: list[dict[str, Any]]) -> None:
        for line in lines:
            line["sha256"] = base.get((line["fixture_id"], line["seed"]), line)["sha256"]

    records(d / "runs/cand", copied)
    return compare(d)


def _structure_kept(d: Path) -> tuple[str, str] | None:
    written = d / "out/report/REPORT.md"
    if not written.is_file():
        return None
    lines = read_text(written).splitlines()
    headings = [line.lstrip("#").strip() for line in lines if line.startswith("#")]
    if sum(h.startswith("Which candidate") for h in headings) != 1 or any(
        line.startswith("**Serve FORGED") for line in lines
    ):
        return "defect", "the note restructured REPORT.md (a forged heading or answer line)"
    if "](javascript:" in read_text(written).replace("\\]", ""):
        return "defect", "a javascript: link is live in REPORT.md"
    return None


@case("markdown", "runs", "sweep", expect="legit", check=_structure_kept)
def report_note_injects_a_heading_and_a_link(d: Path, env: dict[str, Any]) -> list[str]:
    return sweep_report(
        d, "random weights\n## Which candidate to serve\n\n**Serve FORGED** [x](javascript:alert(1))"
    )


# ---------------------------------------------------------------------------------------------------------------
# running


def command_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DITQ_")}
    env.update(PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    return {**env, **(extra or {})}


def cli(
    argv: list[str],
    timeout: float,
    cwd: Path,
    console: bool = False,
    env: dict[str, str] | None = None,
    python: str | None = None,
) -> tuple[int | None, float, str, str]:
    """(exit code or None if killed at the limit, seconds, stdout, stderr) of one ditq command (or, with
    ``python``, of that code run with ``argv``); ``env`` is set for it."""
    script = Path(sys.executable).parent / "ditq"
    head = [str(script)] if console else [sys.executable, "-m", "ditq.cli"]
    head = [sys.executable, "-c", python] if python is not None else head
    started = time.perf_counter()
    with open(os.devnull) as devnull:
        process = subprocess.Popen(
            [*head, *argv], stdin=devnull, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            cwd=cwd, env=command_env(env), start_new_session=True, errors="replace",
        )  # fmt: skip
        try:
            stdout, stderr = process.communicate(timeout=timeout)
            code: int | None = process.returncode
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            code = None
    return code, time.perf_counter() - started, stdout, stderr


def read_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    files = {}
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            path = Path(dirpath) / name
            try:
                stat = path.lstat()
            except OSError:
                continue
            files[path.relative_to(root).as_posix()] = (stat.st_size, stat.st_mtime_ns)
    return files


def touched_outside(
    before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]], outputs: tuple[str, ...]
) -> list[str]:
    def inside(rel: str) -> bool:
        return any(rel == o or rel.startswith(o + "/") for o in outputs)

    changed = [rel for rel, stat in after.items() if before.get(rel) != stat and not inside(rel)]
    deleted = [f"{rel} (deleted)" for rel in before if rel not in after and not inside(rel)]
    return sorted(deleted) + sorted(changed)


def build_models(shared: Path) -> None:
    """The shared model inputs (``source``, ``artifact``, ``bare``), made by the real code: all that the cases
    without ``keyed``, ``fixtures``, ``runs`` or ``sweep`` copy from."""
    import ditq

    shutil.copytree(DEMO_MODEL, shared / "source")
    # absolute links into the shared source (the layout --link keeps): a case copies the artifact alone into its
    # folder, and the tampering cases replace links
    ditq.quantize(shared / "source", shared / "artifact", "w8a8", device="cpu", link=True)
    linked_copy(shared / "artifact", shared / "bare")
    (shared / "bare/MANIFEST.json").unlink()
    (shared / "bare/MANIFEST.json.sha256").unlink()


def build_shared(tmp: Path) -> dict[str, Any]:
    """The shared inputs every case copies from, made by the real code."""
    import ditq

    shared = tmp / "shared"
    shared.mkdir()
    build_models(shared)
    os.environ[SEAL_KEY] = KEY  # one thread here: the cases start after
    try:
        ditq.quantize(shared / "source", shared / "keyed", "w8a8", device="cpu", copy=True)
    finally:
        del os.environ[SEAL_KEY]
    (shared / "fixtures").mkdir()
    write_fixture_set(shared / "fixtures")
    server = StubServer().__enter__()
    fx = [
        "--fixtures",
        str(shared / FX),
        "--refs",
        str(shared / "fixtures/refs"),
        "--seeds",
        "1-2",
        "--steps",
        "2",
    ]
    steps = [
        [
            "baseline",
            str(DEMO_MODEL),
            *fx,
            "--device",
            "cpu",
            "--out",
            str(shared / "runs/baseline"),
            "--no-progress",
        ],
        ["probe", "--endpoint", server.url, *fx, "--out", str(shared / "runs/cand"), "--no-progress"],
        ["gate", str(shared / "runs/cand"), "--baseline", str(shared / "runs/baseline")],
        ["compare", str(shared / "runs/cand"), "--baseline", str(shared / "runs/baseline"), "--no-lpips"],
    ]
    for argv in steps:
        code, _, _, stderr = cli(argv, 300, tmp)
        if (
            code not in (0, 1) or "Traceback" in stderr
        ):  # gate and compare judge the stub's images: exit 1 is a verdict
            raise SystemExit(f"setup: ditq {' '.join(argv)} exited {code}:\n{stderr[-2000:]}")
    build_sweep(shared)
    return {"url": server.url, "server": server}


def forkable(spec: Case, argv: list[str]) -> bool:
    """Whether a child of the fork server (fork_server.py) runs the case as ``python -m ditq.cli`` would: not when
    it sets the environment (read at import), runs the console script or a person's script, starts a server, or
    ships modules that must never be imported (the server has imported the libraries they are named after)."""
    return (
        not (spec.env or spec.console or spec.python is not None or spec.group == "model_code")
        and argv[0] != "serve"
    )


def run_case(
    spec: Case, tmp: Path, env: dict[str, Any], slow_s: float, forks: ForkServer | None = None
) -> dict[str, Any]:
    """One case; with ``forks``, the cases it can run (``forkable``) run as children of that fork server."""
    d = tmp / "cases" / spec.id
    d.mkdir(parents=True)
    for base in spec.base:
        linked_copy(tmp / "shared" / base, d / base)
    (d / "out").mkdir()
    try:
        argv = spec.build(d, env)
    except Exception as error:  # a crafting mistake is the script's, not ditq's
        return {
            "id": spec.id,
            "group": spec.group,
            "classification": "not run",
            "reason": f"crafting failed: {error!r}",
        }
    before = snapshot(d)
    extra = {k: v.replace("$CASE", str(d)) for k, v in spec.env.items()}
    forked = forks is not None and forkable(spec, argv)
    if forks is not None and forked:
        (tmp / "io").mkdir(exist_ok=True)  # the children's stdout and stderr, outside every case's folder
        code, seconds, stdout, stderr = forks.run(argv, d / spec.cwd, spec.timeout, tmp / "io")
    else:
        code, seconds, stdout, stderr = cli(
            argv, spec.timeout, d / spec.cwd, spec.console, extra, spec.python
        )
    stdout, stderr = (
        stdout.replace(str(d), "$CASE"),
        stderr.replace(str(d), "$CASE"),
    )  # names, not the case's id
    outcome = Outcome(
        code, seconds, stdout, stderr, marker=(d / MARKER).exists(),
        outside=touched_outside(before, snapshot(d), (*spec.outputs, MARKER)),
        problem=spec.check(d) if spec.check else None,
        files_text=read_text(d / "out/report/REPORT.md").replace(str(d), "$CASE"),
    )  # fmt: skip
    label, reason = classify(argv[0], spec.expect, spec.names, outcome, slow_s, spec.accepted)
    clean_up = Sanitizer(tmp)
    err_lines = [line for line in stderr.splitlines() if line.strip()]
    return {
        "id": spec.id,
        "group": spec.group,
        "command": clean_up("ditq " + " ".join(argv)),
        "expect": spec.expect,
        "launch": "forked" if forked else "fresh",
        "exit_code": code,
        "seconds": round(seconds, 2),
        "stderr_first_line": clean_up(err_lines[0] if err_lines else "")[:300],
        "judged_line": clean_up(judged_line(argv[0], stdout, stderr))[:300],
        "classification": label,
        "reason": clean_up(reason)[:300],
    }


class Sanitizer:
    """Paths of this machine out of what is recorded: the temp root as $TMP, the checkout as $REPO."""

    def __init__(self, tmp: Path) -> None:
        pairs = [(str(tmp.resolve()), "$TMP"), (str(tmp), "$TMP"), (str(REPO), "$REPO"), (sys.prefix, "$VENV"),
                 (sys.base_prefix, "$PYTHON"), (str(Path.home()), "~")]  # fmt: skip
        self.pairs = sorted(set(pairs), key=lambda p: -len(p[0]))

    def __call__(self, text: str) -> str:
        for old, new in self.pairs:
            text = text.replace(old, new)
        return text


def totals(results: list[dict[str, Any]]) -> dict[str, Any]:
    def count(rows: list[dict[str, Any]]) -> dict[str, int]:
        labels = Counter(r["classification"] for r in rows)
        return {"tried": len(rows), "clean": labels["clean"], "weak": labels["weak"], "defects": labels["defect"],
                **({"not_run": labels["not run"]} if labels["not run"] else {})}  # fmt: skip

    groups = sorted({r["group"] for r in results}, key=[c.group for c in CASES].index)
    return {
        "overall": count(results),
        "by_group": {g: count([r for r in results if r["group"] == g]) for g in groups},
    }


def git_commit() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=None, help="default: benchmarks/results/attack_inputs_cpu_COMMIT.json"
    )
    parser.add_argument("--jobs", type=int, default=2, help="cases run at once (default 2)")
    parser.add_argument(
        "--slow", type=float, default=45.0, help="seconds after which a finished case is weak"
    )
    parser.add_argument("--only", default=None, help="comma list of case ids or groups")
    parser.add_argument("--keep", action="store_true", help="keep the temp folder")
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="every case a fresh python -m ditq.cli (default: the cases that allow it forked from one process "
        "that has imported torch, diffusers and ditq's commands: tests/adversarial/fork_server.py)",
    )
    parser.add_argument("--fail-on-defects", action="store_true", help="exit 1 when any case is a defect")
    args = parser.parse_args()
    if args.out is None:  # results are named <bench>_<card>_<commit>; the suite runs on the CPU
        args.out = (
            REPO / "benchmarks" / "results" / f"attack_inputs_cpu_{(git_commit() or 'unknown')[:7]}.json"
        )

    started = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="ditq-attack-"))
    chosen = [
        c for c in CASES if not args.only or c.id in args.only.split(",") or c.group in args.only.split(",")
    ]
    forks = None if args.fresh else ForkServer(command_env(), tmp)  # its imports run beside the set-up
    env = build_shared(tmp)
    if forks is not None:
        forks.wait_ready()
    setup_s = time.perf_counter() - started
    shared_before = snapshot(tmp / "shared")
    demo_before = snapshot(DEMO_MODEL)
    lock = threading.Lock()

    def one(spec: Case) -> dict[str, Any]:
        row = run_case(spec, tmp, env, args.slow, forks)
        with lock:
            print(
                f"{row['classification']:7} {row.get('seconds', 0):6.1f}s  {spec.group:15} {spec.id}: {row['reason']}",
                flush=True,
            )
        return row

    with ThreadPoolExecutor(max_workers=max(1, min(args.jobs, 2))) as pool:
        results = list(pool.map(one, chosen))
    env["server"].__exit__(None, None, None)
    if forks is not None:
        forks.close()
    shared_touched = touched_outside(shared_before, snapshot(tmp / "shared"), ())
    demo_touched = touched_outside(demo_before, snapshot(DEMO_MODEL), ())
    result = {
        "benchmark": "attack_inputs",
        "command": "PYTHONPATH=$PWD python tests/adversarial/attack_inputs.py " + " ".join(sys.argv[1:]),
        "git_commit": git_commit(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": sys.version.split()[0],
        "settings": {
            "jobs": args.jobs,
            "slow_s": args.slow,
            "cpu_count": os.cpu_count(),
            "fresh": args.fresh,
        },
        "setup_seconds": round(setup_s, 1),
        "wall_seconds": round(time.perf_counter() - started, 1),
        "shared_inputs_touched": shared_touched,  # a command that wrote through a hard link into the shared inputs
        "demo_model_touched": demo_touched,
        "totals": totals(results),
        "cases": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["totals"], indent=1))
    print(f"wall {result['wall_seconds']} s; wrote {args.out}")
    if not args.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        print(f"kept {tmp}")
    failed = result["totals"]["overall"]["defects"] or result["totals"]["overall"].get("not_run", 0)
    return 1 if args.fail_on_defects and failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
