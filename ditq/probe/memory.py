"""Accelerator memory sampler: NVML at 1 Hz, ``nvidia-smi`` when NVML is absent, else "unavailable".

Each sample is one row per device in ``vram.csv``:
``t_unix, device, used_mib, total_mib, process_mib`` where ``process_mib`` is the
memory of the server process (``pid``) on that device when the driver shows it,
empty otherwise. Peaks are taken over a time window (one request) or the run: the
server process's own memory where the driver shows it (summed over its devices),
else the used memory of the server's device (``device``), else of the fullest one.
"""

from __future__ import annotations

import csv
import logging
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ditq.runfiles import MemoryDescription, MemorySource

__all__ = ["MemorySample", "MemorySampler", "memory_series", "peak_mib", "read_vram_csv"]

log = logging.getLogger(__name__)

_FIELDS = ("t_unix", "device", "used_mib", "total_mib", "process_mib")
_MIB = 1024 * 1024


@dataclass(frozen=True)
class MemorySample:
    t_unix: float
    device: int
    used_mib: float
    total_mib: float
    process_mib: float | None


Reader = Callable[[], list[MemorySample]]


def _nvml_reader(pid: int | None) -> Reader:
    import pynvml  # from nvidia-ml-py

    pynvml.nvmlInit()
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    if not handles:
        raise RuntimeError("NVML sees no device")

    def read() -> list[MemorySample]:
        now = time.time()
        samples = []
        for index, handle in enumerate(handles):
            info = pynvml.nvmlDeviceGetMemoryInfo(handle)
            process = None
            if pid is not None:
                for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    if proc.pid == pid and proc.usedGpuMemory is not None:
                        process = proc.usedGpuMemory / _MIB
            samples.append(MemorySample(now, index, info.used / _MIB, info.total / _MIB, process))
        return samples

    return read


def _smi_query(args: list[str]) -> list[list[str]]:
    output = subprocess.run(
        ["nvidia-smi", *args, "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    ).stdout
    return [[field.strip() for field in line.split(",")] for line in output.splitlines() if line.strip()]


def _smi_reader(pid: int | None) -> Reader:
    if shutil.which("nvidia-smi") is None:
        raise RuntimeError("nvidia-smi not found")

    def read() -> list[MemorySample]:
        now = time.time()
        process: dict[str, float] = {}
        if pid is not None:
            for row in _smi_query(["--query-compute-apps=gpu_uuid,pid,used_memory"]):
                if len(row) == 3 and row[1] == str(pid) and row[2].replace(".", "", 1).isdigit():
                    process[row[0]] = float(row[2])
        samples = []
        for row in _smi_query(["--query-gpu=index,uuid,memory.used,memory.total"]):
            index, uuid, used, total = row
            samples.append(MemorySample(now, int(index), float(used), float(total), process.get(uuid)))
        return samples

    if not read():
        raise RuntimeError("nvidia-smi lists no device")
    return read


class MemorySampler:
    """Samples every ``interval_s`` in a thread while started; ``sample_now`` marks window edges."""

    def __init__(
        self,
        csv_path: Path | None,
        interval_s: float = 1.0,
        pid: int | None = None,
        device: int | None = None,
    ) -> None:
        self.csv_path = csv_path
        self.interval_s = interval_s
        self.pid = pid
        self.device = device  # the server's device index, where known
        self.source: MemorySource = "unavailable"
        self.reason = ""
        self._reader: Reader | None = None
        self._samples: list[MemorySample] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._writer: Any = None  # csv writer over _handle while started
        self._handle: Any = None

    def _detect(self) -> None:
        reasons = []
        readers: tuple[tuple[MemorySource, Callable[[int | None], Reader]], ...] = (
            ("nvml", _nvml_reader),
            ("nvidia-smi", _smi_reader),
        )
        for name, factory in readers:
            try:
                self._reader = factory(self.pid)
                self.source = name
                return
            except Exception as error:  # a missing driver shows up in many shapes
                reasons.append(f"{name}: {type(error).__name__}: {error}")
        self.reason = "; ".join(reasons)
        log.info("memory sampling unavailable (%s)", self.reason)

    def start(self) -> MemorySampler:
        self._detect()
        if self._reader is None:
            return self
        if self.csv_path is not None:
            new = not self.csv_path.exists()
            self._handle = open(self.csv_path, "a", newline="")  # noqa: SIM115 - held for the run
            self._writer = csv.writer(self._handle)
            if new:
                self._writer.writerow(_FIELDS)
        self.sample_now()
        self._thread = threading.Thread(target=self._loop, name="ditq-memory-sampler", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample_now()

    def sample_now(self) -> None:
        if self._reader is None:
            return
        try:
            samples = self._reader()
        except Exception as error:  # keep the run going; the gap shows in vram.csv
            log.warning("memory sample failed: %s", error)
            return
        with self._lock:
            self._samples.extend(samples)
            if self._writer is not None:
                for s in samples:
                    self._writer.writerow(
                        [
                            f"{s.t_unix:.3f}",
                            s.device,
                            f"{s.used_mib:.0f}",
                            f"{s.total_mib:.0f}",
                            "" if s.process_mib is None else f"{s.process_mib:.0f}",
                        ]
                    )
                self._handle.flush()

    def peak_between(self, t_start: float, t_end: float) -> float | None:
        with self._lock:
            return peak_mib([s for s in self._samples if t_start <= s.t_unix <= t_end], self.device)

    def peak(self) -> float | None:
        with self._lock:
            return peak_mib(self._samples, self.device)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample_now()
        with self._lock:
            if self._handle is not None:
                self._handle.close()
                self._handle = None
                self._writer = None
        self._reader = None

    @property
    def measures(self) -> str:
        """What a peak is the peak of."""
        with self._lock:
            if any(s.process_mib is not None for s in self._samples):
                return "server process (driver count)"
        return "whole device" if self.device is None else f"whole device {self.device}"

    def describe(self) -> MemoryDescription:
        return MemoryDescription(
            source=self.source,
            interval_s=self.interval_s,
            pid=self.pid,
            device=self.device,
            measures=self.measures,
            reason=self.reason or None,
        )


def memory_series(samples: list[MemorySample], device: int | None = None) -> list[tuple[float, float]]:
    """(t_unix, MiB) per sampling time: the server process's memory summed over its devices where the driver
    shows it, else the used memory of ``device`` (else of the fullest device)."""
    # (time, device) -> MiB: two samples in the same millisecond (a request's edge and the next one's) are one
    per_device: dict[tuple[float, int], float] = {}
    for s in samples:
        if s.process_mib is not None:
            key = (s.t_unix, s.device)
            per_device[key] = max(per_device.get(key, 0.0), s.process_mib)
    process: dict[float, float] = {}
    for (t_unix, _), mib in per_device.items():
        process[t_unix] = process.get(t_unix, 0.0) + mib
    if process:
        return sorted(process.items())
    used: dict[float, float] = {}
    for s in samples:
        if device is None or s.device == device:
            used[s.t_unix] = max(used.get(s.t_unix, 0.0), s.used_mib)
    return sorted(used.items())


def peak_mib(samples: list[MemorySample], device: int | None = None) -> float | None:
    """Highest memory over the samples, in MiB, as ``memory_series`` measures it."""
    return max((mib for _, mib in memory_series(samples, device)), default=None)


def read_vram_csv(path: Path) -> list[MemorySample]:
    if not path.exists():
        return []
    samples = []
    with open(path, newline="") as handle:
        for row in csv.DictReader(handle):
            try:
                process = row.get("process_mib") or None
                samples.append(
                    MemorySample(
                        float(row["t_unix"]),
                        int(row["device"]),
                        float(row["used_mib"]),
                        float(row["total_mib"]),
                        None if process is None else float(process),
                    )
                )
            except (KeyError, TypeError, ValueError):
                continue  # a row torn by a kill
    return samples
