"""End to end on loopback against ditq's own server: baseline -> probe -> gate -> compare.

The server runs the tiny, untrained demo pipeline through the real adapter. Its images
are half-transparent noise, so the default rules must call them collapsed, while rules
without the "transparent" signature plus the baseline envelope must pass a run that
reproduces the baseline exactly.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import pytest
import uvicorn
from harness_kit import probe_run

from ditq.judge.baseline import BaselineOptions, make_baseline, require_sealed
from ditq.judge.compare import ParityBand, compare_run
from ditq.judge.gate import build_envelopes, gate_run, load_rules
from ditq.probe.records import is_success, read_records
from ditq.sweep.health import wait_healthy

serve = pytest.importorskip("ditq.serve")
demo = pytest.importorskip("ditq.demo")


@pytest.fixture(scope="module")
def ditq_server() -> Iterator[str]:
    from ditq.runtime.adapter import PipelineAdapter

    app = serve.create_app(
        serve.ServeConfig(served_model_name="tiny", on_collapse="warn"),
        load=lambda: PipelineAdapter(demo.build_tiny_pipeline(seed=0)),
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
    yield url
    server.should_exit = True
    thread.join(timeout=30)


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
