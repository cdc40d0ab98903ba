"""The command lines of the servers a sweep starts: what the baseline's shares with the candidates' and what not, and
what a parallel sweep refuses before anything runs."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from ditq.demo import default_model_dir, references_dir
from ditq.demo.settings import demo_fixtures
from ditq.errors import InputError
from ditq.runtime.options import LoadOptions
from ditq.sweep import SweepOptions, default_serve_argv


@pytest.fixture
def options(tmp_path: Path) -> SweepOptions:
    return SweepOptions(
        model=default_model_dir(),
        schemes=("fp8",),
        fixtures=demo_fixtures(tmp_path),
        refs=references_dir(),
        out=tmp_path / "sweep",
        load=LoadOptions(device="cpu", kv_cache="int8", compile="inductor"),
    )


def _changed(options: SweepOptions, **change: object) -> SweepOptions:
    """``options`` with ``change``: the servers' load options (LoadOptions' fields) in its ``load``, the rest (the
    offload ladder, --parallel) its own."""
    load = {
        k: change.pop(k) for k in list(change) if k in LoadOptions.__dataclass_fields__ and k != "offload"
    }
    return dataclasses.replace(options, load=options.load.replace(**load), **change)  # type: ignore[arg-type]


def test_every_server_compiles_alike_and_only_candidates_take_the_8_bit_cache(options: SweepOptions) -> None:
    baseline = default_serve_argv(options.model, 8000, options, "auto")
    candidate = default_serve_argv(options.out / "fp8" / "artifact", 8001, options, "auto")
    for argv in (baseline, candidate):
        at = argv.index("--compile")
        assert argv[at + 1 : at + 3] == ["--compile-backend", "inductor"]
    assert "--kv-cache" not in baseline and candidate[candidate.index("--kv-cache") + 1] == "int8"


def test_only_candidates_accumulate_fast_and_an_exact_sweep_says_nothing(options: SweepOptions) -> None:
    fast = _changed(options, accumulate="fast")
    baseline = default_serve_argv(fast.model, 8000, fast, "none")
    candidate = default_serve_argv(fast.out / "fp8" / "artifact", 8001, fast, "none")
    assert "--accumulate" not in baseline and candidate[candidate.index("--accumulate") + 1] == "fast"
    assert "--accumulate" not in default_serve_argv(options.out / "fp8" / "artifact", 8001, options, "none")


def test_an_eager_sweep_starts_eager_servers(options: SweepOptions) -> None:
    eager = _changed(options, compile=None)
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


def test_a_parallel_sweep_starts_every_server_over_the_ranks(options: SweepOptions) -> None:
    parallel = _changed(options, parallel="cp=2", compile=None, device="cuda:0")
    for model in (
        parallel.model,
        parallel.out / "fp8" / "artifact",
    ):  # the baseline's server and a candidate's
        argv = default_serve_argv(model, 8000, parallel, "none")
        at = argv.index("--parallel")
        # the ranks take cuda:0 .. cuda:1 themselves: the server is given the device type, not one device
        assert argv[at + 1 : at + 4] == ["cp=2", "--device", "cuda"] and argv.count("--device") == 1


@pytest.mark.parametrize(
    ("change", "refused"),
    [
        ({"parallel": "cp=1"}, "--parallel 'cp=1': expected cp=N or tp=N with N at least 2"),
        (
            {"parallel": "cp=2", "compile": "inductor"},
            "--parallel cp=2 with --compile inductor: not supported",
        ),
        ({"parallel": "cp=2", "offload": ("none", "model")}, "--parallel cp=2 with --offload none,model"),
        ({"parallel": "cp=2", "max_memory": "24GiB"}, "--parallel cp=2 with --max-memory 24GiB"),
    ],
)
def test_a_parallel_sweep_refuses_what_a_parallel_server_would_before_anything_runs(
    options: SweepOptions, change: dict[str, object], refused: str
) -> None:
    with pytest.raises(InputError, match=re.escape(refused)):
        _changed(options, **{"compile": None, **change})
