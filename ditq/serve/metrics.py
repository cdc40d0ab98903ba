"""Server counters and their Prometheus text exposition (format 0.0.4), written out by hand.

Request counts and latencies are recorded by the HTTP layer; queue depth, drops and out-of-memory
counts are read from the worker at scrape time, so there is one source for each number. Label values come
from fixed sets only (``ENDPOINTS``, HTTP status codes, the request fields' table): a request's own path or
field names never reach the text, so neither a forged line nor one series per path can.
"""

from __future__ import annotations

import bisect
import resource
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from ditq.serve import request_fields
from ditq.serve.request_fields import REQUEST_FIELDS

__all__ = [
    "ENDPOINTS",
    "LATENCY_BUCKETS_S",
    "Gauge",
    "ServerMetrics",
    "endpoint_label",
    "peak_resident_memory_bytes",
    "resident_memory_bytes",
]

# Upper bounds (seconds) of the request latency histogram; +Inf is implied.
LATENCY_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

# Path -> the endpoint label; every other path is "other".
ENDPOINTS = {f"/v1/images/{endpoint}": endpoint for endpoint in request_fields.ENDPOINTS}


def endpoint_label(path: str) -> str:
    return ENDPOINTS.get(path.rstrip("/"), "other")


def resident_memory_bytes() -> int | None:
    """Current resident set size of this process (Linux /proc); None where unavailable."""
    try:
        with open("/proc/self/statm") as handle:
            pages = int(handle.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * resource.getpagesize()


def peak_resident_memory_bytes() -> int:
    """This process's resident high-water mark."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # kilobytes on Linux


@dataclass(frozen=True)
class Gauge:
    """A value read when /metrics is scraped."""

    name: str
    help: str
    read: Callable[[], float | None]
    kind: str = "gauge"


@dataclass
class _Histogram:
    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))
    total: float = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS_S, value)] += 1
        self.total += value


class ServerMetrics:
    """Everything /metrics reports. Thread-safe: the event loop and the worker both write."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}  # (endpoint, status) -> count
        self.latency: dict[str, _Histogram] = {}  # endpoint -> histogram of seconds
        self.collapsed_outputs = 0
        self.ignored_fields: dict[str, int] = {}  # field -> answered requests that gave it to no effect
        self.peak_accelerator_memory_bytes: int | None = None
        self.gauges: list[Gauge] = []

    def observe_request(self, endpoint: str, status: int, seconds: float) -> None:
        if endpoint not in (*ENDPOINTS.values(), "other") or not 100 <= status <= 599:
            raise ValueError(f"metrics: label outside the fixed set ({endpoint!r}, {status!r})")
        with self._lock:
            self.requests[(endpoint, status)] = self.requests.get((endpoint, status), 0) + 1
            self.latency.setdefault(endpoint, _Histogram()).observe(seconds)

    def observe_peak_memory(self, peak_bytes: int | None) -> None:
        if peak_bytes is None:
            return
        with self._lock:
            self.peak_accelerator_memory_bytes = max(self.peak_accelerator_memory_bytes or 0, peak_bytes)

    def count_ignored(self, names: list[str]) -> None:
        unknown = [name for name in names if name not in REQUEST_FIELDS]
        if unknown:
            raise ValueError(f"metrics: label outside the fixed set ({unknown[0]!r})")
        with self._lock:
            for name in names:
                self.ignored_fields[name] = self.ignored_fields.get(name, 0) + 1

    def count_collapsed(self) -> None:
        with self._lock:
            self.collapsed_outputs += 1

    def add_gauge(self, name: str, help: str, read: Callable[[], float | None], kind: str = "gauge") -> None:
        self.gauges.append(Gauge(name, help, read, kind))

    def render(self) -> str:
        """The Prometheus text exposition of every metric."""
        lines: list[str] = []

        def header(name: str, help: str, kind: str) -> None:
            lines.extend((f"# HELP {name} {help}", f"# TYPE {name} {kind}"))

        with self._lock:
            header(
                "ditq_requests_total", "HTTP requests to the images API by endpoint and status.", "counter"
            )
            for (endpoint, status), count in sorted(self.requests.items()):
                lines.append(f'ditq_requests_total{{endpoint="{endpoint}",status="{status}"}} {count}')
            name = "ditq_request_latency_seconds"
            header(name, "Images API request latency, arrival to response, queue wait included.", "histogram")
            for endpoint, histogram in sorted(self.latency.items()):
                cumulative = 0
                for bound, count in zip((*LATENCY_BUCKETS_S, float("inf")), histogram.counts, strict=True):
                    cumulative += count
                    le = "+Inf" if bound == float("inf") else f"{bound:g}"
                    lines.append(f'{name}_bucket{{endpoint="{endpoint}",le="{le}"}} {cumulative}')
                lines.append(f'{name}_sum{{endpoint="{endpoint}"}} {histogram.total:.6f}')
                lines.append(f'{name}_count{{endpoint="{endpoint}"}} {cumulative}')
            header(
                "ditq_collapsed_outputs_total",
                "Generated images with non-finite or collapsed content.",
                "counter",
            )
            lines.append(f"ditq_collapsed_outputs_total {self.collapsed_outputs}")
            header(
                "ditq_ignored_fields_total",
                "Answered requests that gave an OpenAI field the server accepts and ignores, by field.",
                "counter",
            )
            for name, count in sorted(self.ignored_fields.items()):
                lines.append(f'ditq_ignored_fields_total{{field="{name}"}} {count}')
            if self.peak_accelerator_memory_bytes is not None:
                header(
                    "ditq_peak_accelerator_memory_bytes",
                    "Largest per-request peak accelerator memory.",
                    "gauge",
                )
                lines.append(f"ditq_peak_accelerator_memory_bytes {self.peak_accelerator_memory_bytes}")
        for gauge in self.gauges:
            value = gauge.read()
            if value is not None:
                header(gauge.name, gauge.help, gauge.kind)
                lines.append(
                    f"{gauge.name} {value:g}" if isinstance(value, float) else f"{gauge.name} {value}"
                )
        resident = resident_memory_bytes()
        if resident is not None:
            header("process_resident_memory_bytes", "Resident memory of the server process.", "gauge")
            lines.append(f"process_resident_memory_bytes {resident}")
        header("ditq_peak_resident_memory_bytes", "Peak resident memory of the server process.", "gauge")
        lines.append(f"ditq_peak_resident_memory_bytes {peak_resident_memory_bytes()}")
        return "\n".join(lines) + "\n"
