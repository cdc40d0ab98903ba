"""The command lines of the servers a sweep starts: what the baseline's shares with the candidates' and what not."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from ditq.demo import default_model_dir, references_dir
from ditq.demo.settings import demo_fixtures
from ditq.sweep import SweepOptions, default_serve_argv


@pytest.fixture
def options(tmp_path: Path) -> SweepOptions:
    return SweepOptions(
        model=default_model_dir(),
        schemes=("fp8",),
        fixtures=demo_fixtures(tmp_path),
        refs=references_dir(),
        out=tmp_path / "sweep",
        kv_cache="int8",
        compile="inductor",
    )


def test_every_server_compiles_alike_and_only_candidates_take_the_8_bit_cache(options: SweepOptions) -> None:
    baseline = default_serve_argv(options.model, 8000, options, "auto")
    candidate = default_serve_argv(options.out / "fp8" / "artifact", 8001, options, "auto")
    for argv in (baseline, candidate):
        at = argv.index("--compile")
        assert argv[at + 1 : at + 3] == ["--compile-backend", "inductor"]
    assert "--kv-cache" not in baseline and candidate[candidate.index("--kv-cache") + 1] == "int8"


def test_an_eager_sweep_starts_eager_servers(options: SweepOptions) -> None:
    eager = dataclasses.replace(options, compile=None)
    assert "--compile" not in default_serve_argv(eager.model, 8000, eager, "none")


def test_the_sweeps_servers_and_probes_get_exactly_the_sweeps_key(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from ditq.sweep.run import _sweep_keys

    monkeypatch.setenv("DITQ_API_KEY", "exported-by-the-shell")
    monkeypatch.setenv("DITQ_PROBE_API_KEY", "another")
    with _sweep_keys(None):  # what the servers and probes the sweep starts inherit
        assert "DITQ_API_KEY" not in os.environ  # not inherited: its probes would all get 401
        assert "DITQ_PROBE_API_KEY" not in os.environ
    with _sweep_keys("k1"):
        assert os.environ["DITQ_API_KEY"] == "k1"
        assert os.environ["DITQ_PROBE_API_KEY"] == "k1"
    assert os.environ["DITQ_PROBE_API_KEY"] == "another"  # restored
