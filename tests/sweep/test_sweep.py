"""`ditq sweep` end to end on a tiny model: killed mid-probe and resumed, one scheme's server never starts.

The sweep runs in its own process group (a script under the test's temporary directory), so the
kill takes the sweep, its server and its probe down at once, as a crash or Ctrl-C would.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from tiny_models import save_tiny_pipeline

from ditq.errors import InputError
from ditq.report import validate_verdict_file
from ditq.runfiles import (
    BASELINE_COMMANDS_FILE,
    Attempt,
    CandidateFile,
    CommandList,
    SweepFile,
    read_model,
    read_model_list,
    to_json,
    write_model,
)
from ditq.runtime.options import LoadOptions
from ditq.sweep import SCHEME_STAGES, SweepOptions, check_same_model, model_fingerprint, parse_endpoint_for

SEEDS = "1-3"
FIXTURES = {"edit-one": 1, "edit-two": 2}  # fixture id -> reference count; 2 fixtures x 3 seeds = 6 requests

_SCRIPT = """
import sys
from pathlib import Path

from ditq.runtime.options import LoadOptions
from ditq.sweep import SweepOptions, default_serve_argv, run_sweep


def serve_argv(model, port, options, offload):
    if model.parent.name == "fp8":  # this scheme's server dies before it is healthy
        return [sys.executable, "-c", "import sys; sys.exit('cannot start: no device for fp8')"]
    return default_serve_argv(model, port, options, offload)


root = Path(sys.argv[1])
options = SweepOptions(
    model=root / "model",
    schemes=("w8a8", "fp8"),
    fixtures=root / "fixtures.json",
    refs=root / "refs",
    out=root / "out",
    seeds="{seeds}",
    steps=12,  # slow enough that the kill below lands mid-probe
    load=LoadOptions(device="cpu", dtype="float32"),
    parity_db=30.0,
    health_timeout_s=300,
    serve_argv=serve_argv,
)
result = run_sweep(options, command="ditq sweep (test)")
print("VERDICTS", result.verdicts)
"""


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sweep")
    save_tiny_pipeline(root / "model")
    refs = root / "refs"
    refs.mkdir()
    for index in range(2):
        pixels = np.zeros((32, 32, 4), np.uint8)
        pixels[8:24, 8:24, index] = 220
        pixels[..., 3] = 255
        Image.fromarray(pixels, "RGBA").save(refs / f"ref-{index}.png")
    fixtures = {
        fixture_id: {
            "mode": "edit",
            "references": [f"ref-{i}" for i in range(count)],
            "width": 32,
            "height": 32,
            "prompt": "a red square",
            "negative_prompt": None,
        }
        for fixture_id, count in FIXTURES.items()
    }
    (root / "fixtures.json").write_text(json.dumps(fixtures))
    (root / "sweep.py").write_text(_SCRIPT.replace("{seeds}", SEEDS))
    return root


def _start(root: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(root / "sweep.py"), str(root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: the kill below reaches its children too
    )


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


@pytest.mark.slow
def test_sweep_killed_mid_probe_resumes_and_records_a_server_that_never_started(workspace: Path):
    records = workspace / "out" / "w8a8" / "run" / "records.jsonl"
    sweep = _start(workspace)
    deadline = time.monotonic() + 480
    while not _lines(records) and sweep.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert sweep.poll() is None, f"the sweep ended before its probe wrote a record:\n{sweep.stdout.read()}"
    assert _lines(records), "no probe record within the time limit"
    os.killpg(sweep.pid, signal.SIGKILL)
    sweep.wait()
    before = _lines(records)
    assert 1 <= len(before) < 6, "the kill was meant to land mid-probe"

    resumed = _start(workspace)
    output, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, output
    # the resumed sweep skipped what was complete and kept the records written before the kill
    assert "baseline  skipped" in output and "quantize  skipped" in output and "verify    skipped" in output
    after = _lines(records)
    assert after[: len(before)] == before
    keys = [(json.loads(line)["fixture_id"], json.loads(line)["seed"]) for line in after]
    assert len(keys) == len(set(keys)) == 6

    document = validate_verdict_file(workspace / "out" / "report" / "verdict.json")
    by_name = {c.name: c for c in document.candidates}
    fp8, w8a8 = by_name["fp8"], by_name["w8a8"]
    assert fp8.verdict == "NO" and fp8.run is None
    assert fp8.reasons[0].code == "stage_failure"
    assert "serve step failed" in fp8.reasons[0].message and "no device for fp8" in fp8.reasons[0].message
    assert w8a8.run is not None and w8a8.profile.max_references_served == 2
    assert w8a8.profile.artifact_digest and len(w8a8.profile.artifact_digest) == 64
    assert sum(p.requests for p in w8a8.profile.by_references) == 6
    assert (workspace / "out" / "report" / "report.html").is_file()
    candidate = json.loads((workspace / "out" / "fp8" / "CANDIDATE.json").read_text())
    assert candidate["stages"]["serve"]["status"] == "failed"
    assert "probe" not in candidate["stages"]  # never reached
    # the failure names the log that says more, and that log exists: the server's own, since it never started
    logs = re.findall(r"\(log: ([^)]+)\)", candidate["stages"]["serve"]["message"])
    assert logs == [str(workspace / "out" / "fp8" / "logs" / "serve.log")] and Path(logs[0]).is_file()


def test_endpoint_for_is_checked_at_the_edge(tmp_path: Path):
    assert parse_endpoint_for(["W8A8=http://127.0.0.1:9000/"]) == {"w8a8": "http://127.0.0.1:9000"}
    with pytest.raises(InputError, match="SCHEME=http"):
        parse_endpoint_for(["w8a8:9000"])
    with pytest.raises(InputError, match="not one of the swept schemes"):
        SweepOptions(tmp_path, ("w8a8",), tmp_path, tmp_path, tmp_path, endpoint_for={"fp8": "http://x"})
    with pytest.raises(InputError, match="--fixtures"):
        SweepOptions(tmp_path, ("w8a8",), tmp_path / "missing.json", tmp_path, tmp_path)
    # --seeds auto settles the standard's own decisions: the lossless standard needs no band, parity does
    with pytest.raises(InputError, match="--seeds auto --standard parity: needs a parity band"):
        SweepOptions(tmp_path, ("w8a8",), tmp_path, tmp_path, tmp_path, seeds="auto", standard="parity")
    with pytest.raises(InputError, match="--fixtures"):  # past the seeds check: the lossless standard is fine
        SweepOptions(tmp_path, ("w8a8",), tmp_path / "missing.json", tmp_path, tmp_path, seeds="auto")


def _sweep_file(model: Path, fingerprint: dict[str, list[int]] | None) -> SweepFile:
    """SWEEP.json as a sweep writes it (one from before e332eb9 has no fingerprint)."""
    options = {
        "command": "ditq sweep",
        "model": str(model),
        "schemes": ["w8a8"],
        "fixtures": "fixtures.json",
        "refs": "refs",
        "seeds": None,
        "steps": None,
        "max_memory": None,
        "offload": ["none"],
        "note": None,
        "device": "cpu",
        "dtype": None,
        "endpoint_for": {},
        "parity_db": None,
        "parity_pair": None,
        "pid": 1,
    }
    recorded = {} if fingerprint is None else {"model_fingerprint": fingerprint}
    return SweepFile.model_validate({**options, **recorded})


def test_a_sweep_made_from_other_model_files_is_not_resumed(tmp_path: Path):
    model, out = tmp_path / "model", tmp_path / "out"
    (model / "transformer").mkdir(parents=True)
    weights = model / "transformer" / "weights.safetensors"
    weights.write_bytes(b"old weights")
    (model / "model_index.json").write_text("{}")
    before = model_fingerprint(model)
    check_same_model(out, before)  # no earlier sweep: nothing to compare
    out.mkdir()
    write_model(out / "SWEEP.json", _sweep_file(model, before))
    check_same_model(out, model_fingerprint(model))  # unchanged: resumes
    weights.write_bytes(b"new weights, re-trained")
    with pytest.raises(InputError, match=r"transformer/weights.safetensors changed since"):
        check_same_model(out, model_fingerprint(model))
    write_model(out / "SWEEP.json", _sweep_file(model, None))  # an older sweep, no fingerprint
    check_same_model(out, model_fingerprint(model))  # nothing recorded: cannot tell, resumes as before


def test_demo_sweeps_the_seed_matrix_of_the_bundled_fixtures(tmp_path: Path):
    from ditq.demo.settings import DEMO, demo_fixtures

    path = demo_fixtures(tmp_path)
    chosen = json.loads(path.read_text())
    assert sorted(len(f["references"]) for f in chosen.values()) == list(DEMO.references) == [1, 2, 3, 4]
    written = path.stat().st_mtime_ns
    assert demo_fixtures(tmp_path) == path and path.stat().st_mtime_ns == written  # resume sees the same file


def test_demo_measures_its_parity_band_with_the_committed_measurement_s_pair():
    from ditq.demo.settings import DEMO

    measured = json.loads(
        (Path(__file__).parents[2] / "benchmarks/results/demo_parity_cpu_e3f7737.json").read_text()
    )
    assert DEMO.parity_in_process and "in process in bfloat16 against the demo's float32" in measured["what"]
    assert measured["steps"] == DEMO.steps and measured["seeds"] == DEMO.seeds


_LADDER_SCRIPT = """
import sys
from pathlib import Path

from ditq.runtime.options import LoadOptions
from ditq.sweep import SweepOptions, default_serve_argv, run_sweep

root = Path(sys.argv[1])


def serve_argv(model, port, options, offload):
    if offload == "none":  # the model does not fit: ditq serve's exit code for that
        return [sys.executable, "-c", "import sys; print('CUDA out of memory (simulated)'); sys.exit(3)"]
    argv = default_serve_argv(model, port, options, offload)
    if offload == "model":  # a real server whose two-reference generations run out of memory
        return [sys.executable, str(root / "oom_server.py"), *argv[3:]]
    return argv


options = SweepOptions(
    model=root / "model",
    schemes=("w8a8",),
    fixtures=root / "fixtures.json",
    refs=root / "refs",
    out=root / "out-ladder",
    seeds="1-2",
    steps=2,
    load=LoadOptions(device="cpu", dtype="float32"),
    offload=("none", "model", "block"),
    parity_db=30.0,
    health_timeout_s=300,
    serve_argv=serve_argv,
)
result = run_sweep(options, command="ditq sweep --offload auto (test)")
print("VERDICTS", result.verdicts)
"""

# `ditq serve` itself, except that a generation with two or more references raises the error CUDA raises when
# an allocation does not fit: the worker's out-of-memory path runs for real, only the cause is simulated (a
# CPU has no accelerator memory to exhaust).
_OOM_SERVER = """
import sys

import torch

from ditq.cli import main
from ditq.runtime.adapter import PipelineAdapter

generate = PipelineAdapter.__call__


def run_out_with_two_references(self, request):
    if len(request.images) >= 2:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
    return generate(self, request)


PipelineAdapter.__call__ = run_out_with_two_references
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_offload_ladder_serves_what_ran_out_of_memory_at_the_next_mode(workspace: Path):
    (workspace / "ladder.py").write_text(_LADDER_SCRIPT)
    (workspace / "oom_server.py").write_text(_OOM_SERVER)
    sweep = subprocess.run(
        [sys.executable, str(workspace / "ladder.py"), str(workspace)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert sweep.returncode == 0, sweep.stdout + sweep.stderr
    # the ladder's extra rungs and servers are shown against a total fixed at the start, which ends complete
    counts = [tuple(map(int, m)) for m in re.findall(r"^\[\s*(\d+)/(\d+)\]", sweep.stderr, re.MULTILINE)]
    assert len({total for _, total in counts}) == 1 and all(done <= total for done, total in counts)
    assert counts[-1][0] == counts[-1][1] == 1 + 7 + 1  # the baseline, w8a8's seven stages, the report
    out = workspace / "out-ladder"
    candidate = json.loads((out / "w8a8" / "CANDIDATE.json").read_text())
    attempts = [(a["offload"], a["status"], a.get("out_of_memory_after")) for a in candidate["attempts"]]
    assert attempts == [("none", "out_of_memory_at_load", None), ("model", "ok", 2), ("block", "ok", 0)]
    assert candidate["stages"]["serve"]["status"] == "ok" and candidate["stages"]["probe"]["status"] == "ok"
    baseline_attempts = json.loads((out / "logs" / "baseline-attempts.json").read_text())
    assert [a["status"] for a in baseline_attempts] == ["out_of_memory_at_load", "ok", "ok"]
    # what the sweep wrote reads back through the same models, unchanged
    for path, model in ((out / "w8a8" / "CANDIDATE.json", CandidateFile), (out / "SWEEP.json", SweepFile)):
        assert to_json(read_model(model, path)) == json.loads(path.read_text())
    typed = read_model_list(Attempt, out / "logs" / "baseline-attempts.json")
    assert [to_json(a) for a in typed] == baseline_attempts
    commands = read_model(CommandList, out / "logs" / BASELINE_COMMANDS_FILE).root
    assert commands == [c for a in typed for c in (a.command, a.probe_command) if c] and len(commands) == 5
    for run in (out / "w8a8" / "run", out / "baseline"):
        lines = [json.loads(line) for line in _lines(run / "records.jsonl")]
        # one-reference requests were served with model offload; two-reference ones ran out of memory there
        # (503 out_of_memory, kept as history) and were served again with block offload
        by_key = {(r["fixture_id"], r["seed"], r["offload"]): r for r in lines}
        assert len(lines) == 6
        for seed in (1, 2):
            assert by_key[("edit-one", seed, "model")]["http"] == 200
            # out of memory when it ran (503), or refused by the cost model that ran out of memory calibrating it
            # (413): the servers calibrate the fixtures' own size (--max-pixels), this shape among them
            refused = (
                by_key[("edit-two", seed, "model")]["http"],
                by_key[("edit-two", seed, "model")]["error_code"],
            )
            assert refused in ((503, "out_of_memory"), (413, "over_memory_budget"))
            assert by_key[("edit-two", seed, "block")]["http"] == 200
        run_json = json.loads((run / "RUN.json").read_text())
        assert isinstance(run_json["memory"]["pid"], int)  # the sampler was told which process is the server
        invocations = run_json["invocations"]
        assert [i["servers"][0]["health"]["offload"] for i in invocations] == ["model", "block"]
        assert [i["retry"] for i in invocations] == [
            "out_of_memory",
            "out_of_memory",
        ]  # rungs after the first


@pytest.mark.slow
def test_seeds_auto_adds_seeds_to_an_undecided_fixture_until_it_is_decided_or_at_the_cap(workspace: Path):
    from ditq.judge.compare import PSNR_CAP_DB
    from ditq.runfiles import CompareFile
    from ditq.sweep import run_sweep

    out = workspace / "out-auto"

    def sweep(seeds: str | None, parity_db: float) -> None:
        options = SweepOptions(
            model=workspace / "model",
            schemes=("w8a8",),
            fixtures=workspace / "fixtures.json",
            refs=workspace / "refs",
            out=out,
            seeds=seeds,
            max_seeds=6,
            steps=2,
            load=LoadOptions(device="cpu", dtype="float32"),
            parity_db=parity_db,
            standard="parity",  # the band's decisions are the ones settled here
            health_timeout_s=300,
            progress=False,
        )
        run_sweep(options, command="ditq sweep (test)")

    compare_json = out / "w8a8" / "run" / "compare.json"
    sweep(None, 30.0)  # the default seeds; every fixture far inside a 30 dB band
    first = read_model(CompareFile, compare_json)
    psnr = [r.psnr_db for r in first.rows if r.fixture_id == "edit-one" and r.psnr_db is not None]
    assert len(psnr) == 4 and max(psnr) < PSNR_CAP_DB and len(set(psnr)) > 1
    # a stated band whose floor (1 dB under it) is edit-one's mean PSNR: its interval straddles the floor at
    # four seeds whatever the numbers are, so edit-one is undecided and must be given seeds
    stated = sum(psnr) / len(psnr) + 1.0
    sweep("auto", stated)

    sweep_file = read_model(SweepFile, out / "SWEEP.json")
    by_fixture = {
        f: [int(s) for s in _expand(seeds)] for f, seeds in (sweep_file.seeds_by_fixture or {}).items()
    }
    assert sweep_file.max_seeds == 6
    assert 4 < len(by_fixture["edit-one"]) <= 6 and by_fixture["edit-one"][:4] == [2301, 2302, 2303, 2304]
    candidate = read_model(CandidateFile, out / "w8a8" / "CANDIDATE.json")
    assert candidate.seeds_added["edit-one"] == len(by_fixture["edit-one"]) - 4
    # the commands that added them: a server and a probe of the added seeds of the undecided fixture only
    assert any(c.startswith("ditq serve ") for c in candidate.seed_commands)
    assert any(c.startswith("ditq probe ") and "--only edit-one" in c for c in candidate.seed_commands)
    provenance = validate_verdict_file(out / "report" / "verdict.json").provenance
    assert provenance.run_commands["w8a8"][-len(candidate.seed_commands) :] == candidate.seed_commands
    baseline_commands = read_model(CommandList, out / "logs" / BASELINE_COMMANDS_FILE).root
    assert any("--only edit-one" in c for c in baseline_commands)
    last = read_model(CompareFile, compare_json)
    for fixture_id, entry in last.fixtures.items():
        seeds = by_fixture[fixture_id]
        assert entry.parity is not None and entry.parity.n == len(seeds)
        # it stopped where it should: decided, or at the cap
        assert entry.parity.decision != "undecided" or len(seeds) == 6, (fixture_id, entry.parity)
        # a fixture that was given no seeds has records for the default seeds only, in both runs
        for run in (out / "baseline", out / "w8a8" / "run"):
            recorded = {
                json.loads(line)["seed"]
                for line in _lines(run / "records.jsonl")
                if json.loads(line)["fixture_id"] == fixture_id
            }
            assert recorded == set(seeds), (run, fixture_id)
    assert validate_verdict_file(out / "report" / "verdict.json").schema_version == "ditq-verdict-3"


def _expand(seeds: str) -> list[int]:
    from ditq.probe.fixtures import parse_seeds

    return parse_seeds(seeds)


@pytest.mark.slow
def test_fp8_fast_is_judged_beside_fp8_in_one_sweep_its_servers_asked_to_accumulate_fast(workspace: Path):
    """Issue 43: ``--schemes fp8-fast,fp8`` runs both as candidates, fp8 first; the fast one serves fp8's artifact
    (no second quantization: at full size an artifact is 17 GB of disk) and only its servers take ``--accumulate
    fast``; the report says how many layers accumulated fast (none on a CPU, which has no fast path: it must not
    read as fast). A ``w4a8-channel`` candidate rides along: quantized with ``--group-size channel``, its chain
    and report as any other's."""
    from ditq.sweep import run_sweep

    out = workspace / "out-fast"
    options = SweepOptions(
        model=workspace / "model",
        schemes=("fp8-fast", "fp8", "w4a8-channel"),
        fixtures=workspace / "fixtures.json",
        refs=workspace / "refs",
        out=out,
        seeds="1-2",
        steps=2,
        load=LoadOptions(device="cpu", dtype="float32"),
        parity_db=30.0,
        health_timeout_s=300,
        progress=False,
    )
    result = run_sweep(options, command="ditq sweep (test)")
    assert set(result.verdicts) == {"fp8", "fp8-fast", "w4a8-channel"}
    candidates = {
        name: json.loads((out / name / "CANDIDATE.json").read_text()) for name in ("fp8", "fp8-fast")
    }
    assert {name: (c["name"], c["scheme"]) for name, c in candidates.items()} == {
        "fp8": ("fp8", "fp8"),
        "fp8-fast": ("fp8-fast", "fp8"),
    }
    serve = {name: c["attempts"][0]["command"] for name, c in candidates.items()}
    assert "--accumulate fast" in serve["fp8-fast"] and "--accumulate" not in serve["fp8"]
    assert options.candidates == ("fp8", "w4a8-channel", "fp8-fast")
    fast = candidates["fp8-fast"]
    assert fast["artifact"] == str(out / "fp8" / "artifact") and not (out / "fp8-fast" / "artifact").exists()
    assert fast["artifact_digest"] == candidates["fp8"]["artifact_digest"] is not None
    assert [fast["stages"][s]["status"] for s in ("quantize", "verify")] == ["skipped", "skipped"]
    assert fast["stages"]["quantize"]["command"] == candidates["fp8"]["stages"]["quantize"]["command"]
    assert "--scheme fp8 " in fast["stages"]["quantize"]["command"]
    assert all(fast["stages"][s]["status"] == "ok" for s in ("doctor", "serve", "probe", "gate", "compare"))
    health = json.loads((out / "fp8-fast" / "run" / "RUN.json").read_text())["invocations"][0]["servers"][0]
    assert health["health"]["accumulate"] == "fast"
    assert not any(path.endswith("-fast") for path in health["health"]["kernel_paths"])  # a CPU has none
    layers = sum(health["health"]["kernel_paths"].values())
    report = (out / "report" / "REPORT.md").read_text()
    assert f"fast accumulation asked: 0 of {layers} layers fast" in report
    channel = json.loads((out / "w4a8-channel" / "CANDIDATE.json").read_text())
    assert (channel["name"], channel["scheme"], channel["artifact"]) == (
        "w4a8-channel",
        "w4a8",
        str(out / "w4a8-channel" / "artifact"),
    )
    assert "--scheme w4a8 --force --group-size channel " in channel["stages"]["quantize"]["command"]
    assert all(channel["stages"][s]["status"] == "ok" for s in SCHEME_STAGES), channel["stages"]
    assert channel["weight_bytes"] and channel["doctor"] is not None
    stored = json.loads((out / "w4a8-channel" / "artifact" / "MANIFEST.json").read_text())
    assert (stored["options"]["group_size"], stored["scheme"]["group_size"]) == ("channel", None)
    assert "w4a8-channel" in report and "w4a8-channel" in result.verdicts
    # resumed, it serves again only when the shared artifact is another than the one it served
    from ditq.sweep.candidate import Candidate

    assert not Candidate(options, "fp8-fast").dirty
    manifest = out / "fp8" / "artifact" / "MANIFEST.json"
    manifest.write_bytes(manifest.read_bytes() + b"\n")
    assert Candidate(options, "fp8-fast").dirty


def test_a_gptq_candidate_is_an_int_weight_schemes_and_calibrate_gptq_names_them_all():
    from ditq.sweep.options import candidate_name, candidate_scheme

    assert candidate_name("w4a8-gptq") == "w4a8-gptq" and candidate_scheme("w4a8-gptq") == "w4a8"
    assert [candidate_name(s, "gptq") for s in ("fp8", "w4a8", "w8a16", "fp8-fast")] == [
        "fp8",
        "w4a8-gptq",
        "w8a16-gptq",
        "fp8-fast",
    ]
    with pytest.raises(InputError, match=r"--schemes fp8-gptq: GPTQ rounds int weights; fp8's are not"):
        candidate_name("fp8-gptq")


def _workspace_options(
    workspace: Path, schemes: tuple[str, ...], out: str = "out-names", **given: Any
) -> SweepOptions:
    """Sweep options over the workspace's model, fixtures and references, with ``schemes`` (checked as built)."""
    return SweepOptions(
        model=workspace / "model",
        schemes=schemes,
        fixtures=workspace / "fixtures.json",
        refs=workspace / "refs",
        out=workspace / out,
        **given,
    )


def test_a_channel_candidate_is_a_4_bit_schemes_named_before_gptq_and_refused_on_8_bits(workspace: Path):
    """``--schemes w4a8,w4a8-channel``: a 4-bit scheme with one scale per output channel beside its groups of 128;
    with GPTQ the one name is ``SCHEME-channel-gptq``; the 8-bit schemes, per output channel already, refuse it."""
    from ditq.sweep.options import candidate_group_size, candidate_name, candidate_scheme

    assert [candidate_name(s) for s in (" w4a8-channel ", "w4afp8-channel", "int4wo-channel")] == [
        "w4a8-channel",
        "w4a8-channel",
        "w4a16-channel",
    ]
    # --calibrate gptq names it as it names w4a8; either order of the two suffixes is read as the one
    assert candidate_name("w4a8-channel", "gptq") == "w4a8-channel-gptq"
    assert candidate_name("w4a8-gptq-channel") == candidate_name("w4a8-channel-gptq") == "w4a8-channel-gptq"
    for name, group_size in (
        ("w4a8-channel-gptq", "channel"),
        ("w4a8-channel", "channel"),
        ("w4a8-gptq", None),
    ):
        assert (candidate_scheme(name), candidate_group_size(name)) == ("w4a8", group_size)
    for text in ("w8a8-channel", "fp8-channel", "w8a16-channel-gptq"):
        with pytest.raises(InputError, match=r"8-bit|per output channel already") as refused:
            candidate_name(text)
        assert refused.value.field == "schemes" and str(refused.value).startswith(f"--schemes {text}: ")
        assert "\n" not in str(refused.value)
    with pytest.raises(InputError, match=r"--schemes w4a8-channel-channel: channel is named twice"):
        candidate_name("w4a8-channel-channel")
    with pytest.raises(
        InputError, match=r"--schemes w4a8-chanel: unknown suffix -chanel .*did you mean -channel\?"
    ):
        candidate_name("w4a8-chanel")
    with pytest.raises(
        InputError, match=r"unknown scheme 'w4a8-xyz'"
    ):  # nothing near a suffix: the scheme's refusal
        candidate_name("w4a8-xyz")
    with pytest.raises(InputError, match=r"--schemes w4a8-channel-fast: fast accumulation is fp8's only"):
        candidate_name("w4a8-channel-fast")
    assert parse_endpoint_for(["w4a8-gptq-channel=http://127.0.0.1:9"]) == {
        "w4a8-channel-gptq": "http://127.0.0.1:9"
    }
    with pytest.raises(InputError, match=r"--schemes w4a8-gptq-channel: name it as w4a8-channel-gptq"):
        _workspace_options(workspace, ("w4a8-gptq-channel",))


def test_a_channel_candidate_is_quantized_with_group_size_channel_and_gptq_when_named(workspace: Path):
    """The ``ditq quantize`` each candidate runs: ``--group-size channel`` for a ``-channel`` one only, ``--calibrate
    gptq`` on the sweep's fixtures for a ``-gptq`` one, ``--scheme`` the bare scheme, its directory its name; and
    ``ditq quantize`` reads that command line."""
    from ditq.cli import _build_parser
    from ditq.sweep.candidate import Candidate
    from ditq.sweep.run import quantize_argv

    names = ("w4a8", "w4a8-channel", "w4a8-channel-gptq", "w4a16-channel", "fp8")
    options = _workspace_options(workspace, names, "out-channel-argv", load=LoadOptions(device="cpu"))
    assert options.candidates == names
    for name in names:
        c = Candidate(options, name)
        argv = quantize_argv(options, c)
        assert c.dir == options.out / name
        assert argv[3:6] == ["quantize", str(options.model), str(c.dir / "artifact")]
        scheme = name.split("-")[0]
        assert argv[argv.index("--scheme") + 1] == scheme
        assert (argv[argv.index("--group-size") + 1] if "--group-size" in argv else None) == (
            "channel" if "-channel" in name else None
        )
        assert ("--calibrate" in argv) == name.endswith("-gptq")
        args = _build_parser(argv[3:]).parse_args(argv[3:])  # past ``python -m ditq.cli``
        assert (args.scheme, args.group_size) == (scheme, "channel" if "-channel" in name else None)
    # the record the report reads: the candidate's name, its scheme the bare one (as ditq doctor --scheme takes it)
    Candidate(options, "w4a8-channel-gptq").save()
    record = read_model(CandidateFile, options.out / "w4a8-channel-gptq" / "CANDIDATE.json")
    assert (record.name, record.scheme) == ("w4a8-channel-gptq", "w4a8")
    # under a budget the calibration's requests run the source as the servers' last rung places it, within their cap
    capped = _workspace_options(
        workspace,
        ("w4a8-gptq", "fp8"),
        "out-capped-argv",
        load=LoadOptions(device="cuda", max_memory="16GiB"),
        offload=("none", "auto"),
    )
    calibrated, rounded = (quantize_argv(capped, Candidate(capped, n)) for n in ("w4a8-gptq", "fp8"))
    args = _build_parser(calibrated[3:]).parse_args(calibrated[3:])
    assert (args.calibrate, args.offload, args.max_memory) == ("gptq", "auto", "16GiB")
    assert "--offload" not in rounded and "--max-memory" not in rounded  # round to nearest streams the files


def test_the_calibrations_options_reach_every_gptq_candidates_quantize_and_only_where_one_is(workspace: Path):
    """``--calibration-seeds/-steps/-memory`` as ``ditq quantize`` reads them, on each GPTQ candidate's command line
    and no other's (quantize's defaults without them); a sweep that rounds nothing by GPTQ refuses them by name."""
    from ditq.cli import _build_parser
    from ditq.sweep.candidate import Candidate
    from ditq.sweep.options import Calibration
    from ditq.sweep.run import quantize_argv

    given = Calibration(seeds="0-2", steps=2, memory="16GiB")
    options = _workspace_options(
        workspace, ("w4a8-gptq", "w4a8", "fp8"), "out-calibration", calibration=given
    )
    calibrated, rounded, fp8 = (quantize_argv(options, Candidate(options, n)) for n in options.candidates)
    args = _build_parser(calibrated[3:]).parse_args(calibrated[3:])
    assert (args.calibration_seeds, args.calibration_steps, args.calibration_memory) == (
        (0, 1, 2),
        2,
        16 << 30,
    )
    assert not any(a.startswith("--calibration") for a in rounded + fp8)
    plain = _workspace_options(workspace, ("w4a8-gptq",), "out-calibration-default")
    args = _build_parser(quantize_argv(plain, Candidate(plain, "w4a8-gptq"))[3:]).parse_args(
        quantize_argv(plain, Candidate(plain, "w4a8-gptq"))[3:]
    )
    assert (args.calibration_seeds, args.calibration_steps, args.calibration_memory) == (None, None, None)
    with pytest.raises(
        InputError, match=r"^--calibration-steps: no candidate of this sweep is rounded by GPTQ"
    ):
        _workspace_options(workspace, ("w4a8", "fp8"), "out-no-gptq", calibration=Calibration(steps=2))
    with pytest.raises(InputError, match=r"^--calibration-steps: at least 1, got 0"):
        _workspace_options(workspace, ("w4a8-gptq",), "out-zero", calibration=Calibration(steps=0))
    # calibrated at a seed the probes judge, a candidate would be judged on images it was fitted to
    with pytest.raises(InputError, match=r"^--calibration-seeds 0,2302: seed 2302 is one the probes judge"):
        _workspace_options(workspace, ("w4a8-gptq",), "out-shared", calibration=Calibration(seeds="0,2302"))
    with pytest.raises(InputError, match=r"^--calibration-seeds 7: seed 7 is one the probes judge"):
        _workspace_options(
            workspace, ("w4a8-gptq",), "out-own", seeds="5-8", calibration=Calibration(seeds="7")
        )
    with pytest.raises(InputError, match=r"^--calibration-seeds 2310: seed 2310 is one the probes judge"):
        _workspace_options(
            workspace, ("w4a8-gptq",), "out-auto", seeds="auto", calibration=Calibration(seeds="2310")
        )
    apart = _workspace_options(
        workspace, ("w4a8-gptq",), "out-apart", seeds="5-8", calibration=Calibration(seeds="0-4")
    )
    assert apart.calibration.flags() == ["--calibration-seeds", "0-4"]


def test_a_fast_candidate_is_fp8s_only_and_named_in_one_spelling(workspace: Path):
    from ditq.sweep.options import candidate_name, candidate_options, shared_candidate

    assert candidate_name(" fp8-fast ") == "fp8-fast"
    with pytest.raises(InputError, match=r"--schemes w8a8-fast: fast accumulation is fp8's only"):
        candidate_name("w8a8-fast")
    options = _workspace_options(workspace, ("fp8", "fp8-fast"), load=LoadOptions(device="cpu"))
    assert candidate_options(options, "fp8").load.accumulate == "exact"
    assert candidate_options(options, "fp8-fast").load.accumulate == "fast"
    assert candidate_options(options, "baseline") is options
    assert shared_candidate(options, "fp8-fast") == "fp8" and shared_candidate(options, "fp8") is None
    alone = dataclasses.replace(options, schemes=("fp8-fast",))
    assert shared_candidate(alone, "fp8-fast") is None  # without fp8 in the sweep it quantizes its own
    assert parse_endpoint_for(["fp8-fast=http://127.0.0.1:9"]) == {"fp8-fast": "http://127.0.0.1:9"}
    with pytest.raises(InputError, match="w8a16-fast"):
        _workspace_options(workspace, ("w8a16-fast",))
