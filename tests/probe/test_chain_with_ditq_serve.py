"""End to end on loopback against ditq's own server: baseline -> probe -> gate -> compare.

The server runs the tiny, untrained demo pipeline through the real adapter. Its images
are half-transparent noise, so the default rules must call them collapsed, while rules
without the "transparent" signature plus the baseline envelope must pass a run that
reproduces the baseline exactly.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import pytest
import uvicorn
from harness_kit import probe_run
from tiny_models import tiny_adapter

from ditq.judge.baseline import BaselineOptions, make_baseline, require_sealed
from ditq.judge.compare import ParityBand, compare_run
from ditq.judge.gate import build_envelopes, gate_run, load_rules
from ditq.probe.records import is_success, read_records
from ditq.sweep.health import wait_healthy

serve = pytest.importorskip("ditq.serve")
demo = pytest.importorskip("ditq.demo")


@contextlib.contextmanager
def _tiny_server(api_key: str | None = None) -> Iterator[str]:
    """ditq serve's app over the tiny demo pipeline on a free loopback port (with ``api_key``: as `ditq serve
    --api-key KEY` starts it); its URL once /health, which needs no key, answers."""

    app = serve.create_app(
        serve.ServeConfig(served_model_name="tiny", on_collapse="warn", api_key=api_key),
        load=tiny_adapter,
        doctor=lambda _adapter: serve.DoctorOutcome("passed", "no quantized layers"),
        model_root="tiny-demo",
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    problem = wait_healthy(url, 120, interval_s=0.1)
    assert problem is None, f"ditq serve did not become ready: {problem}"
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def ditq_server() -> Iterator[str]:
    with _tiny_server() as url:
        yield url


def test_baseline_probe_gate_compare(tmp_path: Path, fixture_set, ditq_server: str) -> None:
    fixtures, refs = fixture_set
    baseline = tmp_path / "baseline"
    make_baseline(
        BaselineOptions(
            model=Path("tiny-demo"),
            fixtures=fixtures,
            refs=refs,
            out=baseline,
            seeds=[1, 2],
            steps=4,  # as probe_run sends
            endpoint=ditq_server,
            progress=False,
        )
    )
    assert require_sealed(baseline, allow_unsealed=False) == "sealed"
    probe_run(ditq_server, fixture_set, tmp_path / "candidate", [1, 2])
    records = read_records(tmp_path / "candidate")
    assert len(records) == 6 and all(is_success(r) for r in records), [r.error for r in records]
    assert all(r.metrics for r in records)  # the server's stage metrics are kept

    default = gate_run(tmp_path / "candidate", load_rules())
    assert not default.passed and all(
        any(x.startswith("transparent") for x in r.reasons) for r in default.records
    )

    raw = json.loads(resources.files("ditq.judge").joinpath("gate_rules.json").read_text())
    raw["signatures"] = [s for s in raw["signatures"] if s["name"] != "transparent"]
    lenient = tmp_path / "rules.json"
    lenient.write_text(json.dumps(raw))
    rules = load_rules(lenient)
    result = gate_run(tmp_path / "candidate", rules, build_envelopes(baseline, rules))
    assert result.passed, [r.reasons for r in result.records]

    comparison = compare_run(tmp_path / "candidate", baseline, parity=ParityBand("stated", 27.6, {}, 1.0))
    assert comparison.overall.ok == 6 and comparison.parity is not None and comparison.parity.inside


@pytest.fixture(scope="module")
def keyed_server() -> Iterator[str]:
    with _tiny_server(api_key="s3cret") as url:
        yield url


def test_a_baseline_refused_on_every_request_fails_unsealed_and_one_with_the_key_is_sealed(
    tmp_path: Path, fixture_set, keyed_server: str
) -> None:
    from ditq.errors import DitqError

    fixtures, refs = fixture_set

    def baseline(out: Path, api_key: str | None) -> None:
        make_baseline(
            BaselineOptions(
                model=Path("tiny-demo"), fixtures=fixtures, refs=refs, out=out, seeds=[1], steps=4,
                endpoint=keyed_server, progress=False, api_key=api_key,
            )
        )  # fmt: skip

    with pytest.raises(DitqError, match=r"every one of the 3 requests failed \(first: .*HTTP 401"):
        baseline(tmp_path / "no-key", None)
    assert not (tmp_path / "no-key" / "SEAL.json").exists()  # never sealed, never 'complete'
    assert json.loads((tmp_path / "no-key" / "RUN.json").read_text())["status"] == "failed"
    baseline(tmp_path / "keyed", "s3cret")
    assert require_sealed(tmp_path / "keyed", allow_unsealed=False) == "sealed"
    assert all(is_success(r) for r in read_records(tmp_path / "keyed"))
    assert not any("s3cret" in p.read_text(errors="ignore") for p in (tmp_path / "keyed").glob("*.json*"))


def test_the_probe_command_sends_the_key_from_its_flag_or_the_environment(
    tmp_path: Path, fixture_set, keyed_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from harness_kit import probe_argv

    from ditq.cli import main

    assert (
        main(probe_argv(keyed_server, fixture_set, tmp_path / "flag", "--api-key", "s3cret", seeds="1")) == 0
    )
    monkeypatch.setenv("DITQ_PROBE_API_KEY", "s3cret")
    assert main(probe_argv(keyed_server, fixture_set, tmp_path / "env", seeds="1")) == 0
    assert all(is_success(r) for r in read_records(tmp_path / "env"))
