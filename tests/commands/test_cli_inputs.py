"""Bad input is refused in one line naming the flag (or file) and the value, exit code 2, before any work starts:
no server is started, nothing is written under --out, no model is looked up on the hub."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ditq.cli import main
from ditq.demo import default_model_dir, fixtures_path, references_dir

DEMO_MODEL = str(default_model_dir())
FIXTURES = ["--fixtures", str(fixtures_path()), "--refs", str(references_dir())]

# (argv with {out} and {tmp}, what the one line says)
REFUSED = [
    (["sweep", DEMO_MODEL, *FIXTURES, "--out", "{out}", "--seeds", "abc"], "--seeds: cannot read 'abc'"),
    (["sweep", DEMO_MODEL, *FIXTURES, "--out", "{out}", "--seeds", "5-1"], "--seeds: cannot read '5-1'"),
    (["sweep", DEMO_MODEL, *FIXTURES, "--out", "{out}", "--seeds", "auto", "--max-seeds", "2"], "--max-seeds: at least 4"),
    (["sweep", DEMO_MODEL, *FIXTURES, "--out", "{out}", "--steps", "0"], "--steps: at least 1, got 0"),
    (["sweep", DEMO_MODEL, *FIXTURES, "--out", "{out}", "--max-memory", "24XB"], "--max-memory: cannot read '24XB'"),
    (["sweep", DEMO_MODEL, *FIXTURES, "--out", "{out}", "--device", "cpu", "--max-memory", "24GiB"],
     "--max-memory 24GiB: caps accelerator memory; device 'cpu' has none to cap"),
    (["sweep", DEMO_MODEL, *FIXTURES, "--out", "{out}", "--schemes", "int8"], "scheme 'int8' fits more than one"),
    (["sweep", DEMO_MODEL, *FIXTURES, "--out", "{out}", "--schemes", "fp8", "--calibration-steps", "2"],
     "--calibration-steps: no candidate of this sweep is rounded by GPTQ"),
    (["sweep", DEMO_MODEL, *FIXTURES, "--out", "{out}", "--schemes", "w4a8-channel,w8a8-channel"],
     "--schemes w8a8-channel: one scale per output channel is the 4-bit schemes' option"),
    (["sweep", DEMO_MODEL, "--fixtures", "{tmp}/none.json", "--refs", "{tmp}", "--out", "{out}"],
     "--fixtures: {tmp}/none.json does not exist"),
    (["sweep", DEMO_MODEL, "--fixtures", str(fixtures_path()), "--refs", "{tmp}/refs", "--out", "{out}"],
     "--refs: {tmp}/refs does not exist"),
    (["sweep", "{tmp}/empty", *FIXTURES, "--out", "{out}"], "{tmp}/empty/model_index.json: names no component"),
    (["baseline", DEMO_MODEL, *FIXTURES, "--out", "{out}", "--seeds", "abc"], "--seeds: cannot read 'abc'"),
    (["probe", "--endpoint", "http://127.0.0.1:9", *FIXTURES, "--out", "{out}", "--seeds", "2-x"],
     "--seeds: cannot read '2-x'"),
    (["demo", "--out", "{out}", "--seeds", "abc"], "--seeds: cannot read 'abc'"),
    (["quantize", "{tmp}/nope/model", "{tmp}/taken"], "{tmp}/nope/model: no such directory"),
    (["quantize", DEMO_MODEL, "{out}", "--scheme", "int8"], "scheme 'int8' fits more than one scheme: w8a16"),
    (["quantize", "{tmp}/empty", "{out}"], "{tmp}/empty/model_index.json: names no component"),
    (["serve", "artifacts/does-not-exist"], "artifacts/does-not-exist: no such directory (artifacts exists here"),
    (["generate", "artifacts/typo/model", "--prompt", "a star"], "artifacts/typo/model: no such directory"),
    (["generate", "--prompt", "a star", "--cache", "mag:0.1"], "--cache mag:0.1: MagCache needs magnitude ratios"),
    (["generate", "--prompt", "a star", "--cache", "auto"], "--cache auto: only ditq sweep and ditq demo search a setting"),
    (["serve", "--cache", "first-block:x"], "--cache first-block:x: expected first-block:THRESHOLD"),
    (["serve", "--cache", "taylorseer:2", "--compile"], "--cache taylorseer:2:3 with --compile: not supported"),
    (["demo", "--out", "{out}", "--cache", "fast"], "--cache fast: not a step cache"),
    (["sweep", DEMO_MODEL, *FIXTURES, "--out", "{out}", "--cache", "auto", "--seeds", "auto"],
     "--cache auto with --seeds auto: give the seeds"),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "said"), REFUSED, ids=[f"{a[0]}: {said[:40]}" for a, said in REFUSED])
def test_bad_input_is_one_line_before_any_work(
    argv: list[str],
    said: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(
        "HF_HUB_OFFLINE", "1"
    )  # were anything looked up on the hub, it would not leave the machine
    (tmp_path / "artifacts").mkdir()  # beside it, artifacts/... is a path, never a hub id
    (tmp_path / "taken").mkdir()  # an output that exists: the missing source is said first
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    out = tmp_path / "out"
    code = main([part.format(out=out, tmp=tmp_path) for part in argv])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"ditq {argv[0]}: error: ") and said.format(tmp=tmp_path) in err, err
    assert not out.exists()  # no work started: nothing written, no server's log
