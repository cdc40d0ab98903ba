"""Memory sampling: nvidia-smi fallback (a stand-in executable on PATH), and 'unavailable' without a GPU."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from harness_kit import probe_run
from stub_images_server import StubServer

import ditq.probe.memory as memory
from ditq.judge.gate import gate_run, load_rules
from ditq.probe.memory import MemorySampler, read_vram_csv
from ditq.probe.records import read_records

FAKE_SMI = """#!/bin/sh
case "$*" in
  *query-gpu*) echo "0, GPU-aaa, 1234, 81559"; echo "1, GPU-bbb, 2000, 81559" ;;
  *query-compute-apps*) echo "GPU-aaa, 4242, 1000"; echo "GPU-bbb, 999, 10" ;;
esac
"""


def _no_nvml(pid: int | None) -> memory.Reader:
    raise RuntimeError("NVML library not present")


@pytest.fixture
def fake_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the nvidia-smi route: NVML reported absent, a stand-in nvidia-smi first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(FAKE_SMI)
    (bin_dir / "nvidia-smi").chmod(0o755)
    monkeypatch.setattr(memory, "_nvml_reader", _no_nvml)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")


def test_nvidia_smi_fallback_samples_devices_and_the_server_process(tmp_path: Path, fake_smi: None) -> None:
    csv_path = tmp_path / "vram.csv"
    sampler = MemorySampler(csv_path, interval_s=0.05, pid=4242).start()
    t0 = time.time()
    deadline = time.monotonic() + 20  # each round starts a process: slow on a loaded machine
    while len(read_vram_csv(csv_path)) < 6 and time.monotonic() < deadline:
        time.sleep(0.05)
    sampler.stop()
    assert sampler.source == "nvidia-smi"
    samples = read_vram_csv(csv_path)
    assert len(samples) >= 6 and {s.device for s in samples} == {0, 1}
    assert {s.process_mib for s in samples if s.device == 0} == {1000.0}
    assert {s.process_mib for s in samples if s.device == 1} == {None}
    # the peak is the server process's own memory (1000 MiB on device 0), not another process's device 1
    assert sampler.peak() == 1000.0 and sampler.peak_between(t0, time.time()) == 1000.0
    assert sampler.peak_between(0.0, 1.0) is None
    assert memory.peak_mib([s for s in samples if s.device == 1]) == 2000.0  # no process: the device's use
    without_process = [
        memory.MemorySample(s.t_unix, s.device, s.used_mib, s.total_mib, None) for s in samples
    ]
    assert memory.peak_mib(without_process) == 2000.0  # the fullest device
    assert memory.peak_mib(without_process, device=0) == 1234.0  # the server's device, when known
    # two samples within one millisecond (one request's last, the next one's first) are one sample, not a sum
    twice = [
        memory.MemorySample(1.0, 0, 2000.0, 8000.0, 1000.0),
        memory.MemorySample(1.0, 0, 2000.0, 8000.0, 1000.0),
    ]
    assert memory.peak_mib(twice) == 1000.0


def test_probe_records_peaks_and_gate_reads_vram_csv(tmp_path: Path, fixture_set, fake_smi: None) -> None:
    with StubServer() as server:
        probe_run(server.url, fixture_set, tmp_path / "run", [1], server_pid=4242)
    run = json.loads((tmp_path / "run" / "RUN.json").read_text())
    assert run["memory"]["source"] == "nvidia-smi" and run["peak_memory_mib"] == 1000.0
    assert run["memory"]["measures"] == "server process (driver count)"
    assert all(r.peak_memory_mib == 1000.0 for r in read_records(tmp_path / "run"))
    result = gate_run(tmp_path / "run", load_rules())
    assert (result.run_peak_memory_mib, result.run_peak_source) == (1000.0, "vram.csv")


def test_without_a_gpu_memory_is_unavailable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "_nvml_reader", _no_nvml)
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi anywhere
    sampler = MemorySampler(tmp_path / "vram.csv").start()
    sampler.sample_now()
    sampler.stop()
    assert sampler.source == "unavailable"
    assert "NVML library not present" in sampler.reason and "nvidia-smi not found" in sampler.reason
    assert sampler.peak() is None and not (tmp_path / "vram.csv").exists()
