"""Load test of `ditq serve` on loopback: C concurrent clients for D seconds, then a burst past the queue.

    python benchmarks/serve_load.py --out benchmarks/results/serve_load_cpu_COMMIT.json

Starts `ditq serve MODEL` (default: the bundled demo model) as a subprocess on a free loopback port with
``--max-queue`` = clients, so a steady phase of ``clients`` closed-loop clients (each sends its next
request when the previous one is answered) can never fill the queue: every answer must be 200 and no
429 may appear. Requests cycle through the demo fixtures (text-to-image and edits with 1-4 references). Then a burst of
``clients + 1 + extra`` simultaneous requests: at most ``extra`` (those beyond 1 running + max_queue
waiting) may get 429, every other one must be 200.

Before the steady phase, one request per fixture runs alone (warm-up: every request shape has been
served once). Resident memory of the server is sampled every second from /proc (Linux). Growth
compares the mean of the first and the last ``--window`` seconds of the steady phase (which ends when
the last steady request is answered). The JSON records the command, versions, settings, per-status counts, latencies,
throughput, the memory series and the pass/fail of each criterion.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from PIL import Image
from result_names import result_path

from ditq.sweep.health import wait_healthy

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def demo_requests() -> list[dict[str, Any]]:
    """The demo fixtures as requests: prompt, size and reference PNG bytes (0 to 4 references)."""
    from ditq.demo import fixtures_path, references_dir

    fixtures = json.loads(fixtures_path().read_text())
    return [
        {
            "id": name,
            "prompt": fixture["prompt"],
            "size": f"{fixture['width']}x{fixture['height']}",
            "references": [(references_dir() / f"{ref}.png").read_bytes() for ref in fixture["references"]],
        }
        for name, fixture in fixtures.items()
    ]


class Load:
    """Closed-loop clients: each records (phase, endpoint, status, seconds, error code) per request."""

    def __init__(self, base: str, args: argparse.Namespace) -> None:
        self.base, self.args = base, args
        self.records: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.requests = demo_requests()

    def one(self, client: httpx.Client, phase: str, index: int) -> None:
        fixture = self.requests[index % len(self.requests)]
        fields = {
            "prompt": fixture["prompt"],
            "size": self.args.size or fixture["size"],
            "num_inference_steps": self.args.steps,
            "seed": index,
        }
        endpoint = "edits" if fixture["references"] else "generations"
        record: dict[str, Any] = {"phase": phase, "endpoint": endpoint, "fixture": fixture["id"]}
        started = record["start_s"] = time.perf_counter()
        try:
            if endpoint == "edits":
                files = [
                    ("image[]", (f"ref{i}.png", data, "image/png"))
                    for i, data in enumerate(fixture["references"])
                ]
                data = {key: str(value) for key, value in fields.items()}
                response = client.post(f"{self.base}/v1/images/edits", data=data, files=files)
            else:
                response = client.post(f"{self.base}/v1/images/generations", json=fields)
            record["status"] = response.status_code
            if response.status_code == 200:
                body = response.json()
                Image.open(io.BytesIO(base64.b64decode(body["data"][0]["b64_json"]))).load()
                record["queue_wait_ms"] = body["metrics"]["queue_wait_ms"]
                record["generation_ms"] = body["metrics"]["generation_ms"]
            else:
                record["code"] = response.json()["error"]["code"]
        except Exception as error:  # a lost request: recorded, counted, never raised
            record["status"] = None
            record["code"] = f"{type(error).__name__}: {error}"
        record["seconds"] = time.perf_counter() - started
        with self.lock:
            self.records.append(record)

    def steady(self) -> None:
        deadline = time.perf_counter() + self.args.duration
        counter = iter(range(10**9))

        def client_loop() -> None:
            with httpx.Client(timeout=self.args.timeout) as client:
                while time.perf_counter() < deadline:
                    self.one(client, "steady", next(counter))

        threads = [threading.Thread(target=client_loop) for _ in range(self.args.clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def warmup(self) -> None:
        """One request per fixture, one at a time: every request shape has been seen before measuring."""
        with httpx.Client(timeout=self.args.timeout) as client:
            for index in range(len(self.requests)):
                self.one(client, "warmup", index)

    def burst(self, size: int) -> None:
        barrier = threading.Barrier(size)

        def fire(index: int) -> None:
            with httpx.Client(timeout=self.args.timeout) as client:
                barrier.wait()
                self.one(client, "burst", index)

        threads = [threading.Thread(target=fire, args=(i,)) for i in range(size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()


def sample_memory(pid: int, stop: threading.Event, series: list[tuple[float, int]]) -> None:
    while not stop.wait(1.0):
        value = rss_bytes(pid)
        if value is not None:
            series.append((time.perf_counter(), value))


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(load: Load, series: list[tuple[float, int]], args: argparse.Namespace) -> dict[str, Any]:
    steady = [r for r in load.records if r["phase"] == "steady"]
    burst = [r for r in load.records if r["phase"] == "burst"]
    ok = [r for r in steady if r["status"] == 200]
    latencies = [r["seconds"] for r in ok]
    steady_start = min((r["start_s"] for r in steady), default=None)
    steady_end = max((r["start_s"] + r["seconds"] for r in steady), default=None)
    memory: dict[str, Any] = {"window_s": args.window}
    if steady_start is not None and steady_end is not None:
        warm = [(t, v) for t, v in series if steady_start <= t <= steady_end]
        first = [v for t, v in warm if t <= steady_start + args.window]
        last = [v for t, v in warm if t >= steady_end - args.window]
        if first and last:
            memory.update(
                first_window_mean_mib=statistics.mean(first) / 2**20,
                last_window_mean_mib=statistics.mean(last) / 2**20,
                growth_percent=100 * (statistics.mean(last) / statistics.mean(first) - 1),
            )
        memory["series_mib"] = [round(v / 2**20, 1) for _, v in warm]
    warmup = [r for r in load.records if r["phase"] == "warmup"]
    beyond = len(burst) - (1 + args.clients)
    burst_429 = sum(r["status"] == 429 for r in burst)
    criteria = {
        "zero_lost": all(r["status"] is not None for r in load.records),
        "zero_failed_valid_requests_steady": all(r["status"] == 200 for r in steady + warmup),
        "no_429_within_queue_bound": not any(r["status"] == 429 for r in steady),
        "burst_429_only_beyond_bound": burst_429 <= beyond and all(r["status"] in (200, 429) for r in burst),
        "rss_growth_below_10_percent": memory.get("growth_percent") is not None
        and memory["growth_percent"] < 10,
    }
    by_status: dict[str, int] = {}
    for record in load.records:
        key = f"{record['phase']}:{record['endpoint']}:{record['status']}"
        by_status[key] = by_status.get(key, 0) + 1
    return {
        "steady": {
            "requests": len(steady),
            "ok": len(ok),
            "images_per_s": len(ok) / (steady_end - steady_start)
            if ok and steady_start is not None and steady_end is not None
            else None,
            "latency_s": {
                "mean": statistics.mean(latencies) if latencies else None,
                "p50": percentile(latencies, 0.5),
                "p90": percentile(latencies, 0.9),
                "p99": percentile(latencies, 0.99),
                "max": max(latencies, default=None),
            },
            "generation_ms_mean": statistics.mean(r["generation_ms"] for r in ok) if ok else None,
            "queue_wait_ms_mean": statistics.mean(r["queue_wait_ms"] for r in ok) if ok else None,
        },
        "burst": {
            "requests": len(burst),
            "beyond_bound": beyond,
            "got_429": burst_429,
            "got_200": sum(r["status"] == 200 for r in burst),
        },
        "by_phase_endpoint_status": by_status,
        "errors": sorted({r["code"] for r in load.records if r.get("code")}),
        "resident_memory": memory,
        "criteria": criteria,
        "passed": all(criteria.values()),
    }


def git_commit(repo: Path = REPO) -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def environment() -> dict[str, Any]:
    """Where a benchmark ran: Python, machine, cores, torch."""
    return {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": __import__("torch").__version__,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="model directory (default: the bundled demo model)")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of the steady phase")
    parser.add_argument("--extra", type=int, default=3, help="burst requests beyond 1 running + max_queue")
    parser.add_argument("--size", help="WxH for every request (default: each fixture's own size)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--window", type=float, default=10.0, help="seconds of each memory window")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--serve-arg", action="append", default=[], help="extra argument for ditq serve")
    parser.add_argument("--out", type=Path, default=result_path("serve_load", "cpu"))
    args = parser.parse_args()

    load_average_before = os.getloadavg()
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "ditq.cli",
        "serve",
        *([str(args.model)] if args.model else []),
        "--port",
        str(port),
        "--max-queue",
        str(args.clients),
        *args.serve_arg,
    ]
    log = tempfile.NamedTemporaryFile("w", prefix="serve_load-", suffix=".log", delete=False)  # noqa: SIM115
    log_path = log.name
    with log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    base = f"http://127.0.0.1:{port}"
    series: list[tuple[float, int]] = []
    stop = threading.Event()
    try:
        problem = wait_healthy(base, 300, server)
        if problem is not None:
            raise SystemExit(f"ditq serve: {problem}; see {log_path}")
        sampler = threading.Thread(target=sample_memory, args=(server.pid, stop, series), daemon=True)
        sampler.start()
        load = Load(base, args)
        load.warmup()
        started = time.perf_counter()
        load.steady()
        steady_wall = time.perf_counter() - started
        load.burst(1 + args.clients + args.extra)
        metrics_text = httpx.get(f"{base}/metrics").text
    finally:
        stop.set()
        server.terminate()
        server.wait(120)
    result = {
        "benchmark": "serve_load",
        "command": "python benchmarks/serve_load.py " + " ".join(sys.argv[1:]),
        "server_command": "ditq serve " + " ".join(command[4:]),
        "git_commit": git_commit(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "environment": {
            **environment(),
            "load_average_1_5_15_min_before": [round(v, 2) for v in load_average_before],
            "load_average_1_5_15_min_after": [round(v, 2) for v in os.getloadavg()],
            "note": "CPU only; the cores are shared with other work, so latencies are indicative",
        },
        "settings": {
            "clients": args.clients,
            "duration_s": args.duration,
            "steady_wall_s": steady_wall,
            "max_queue": args.clients,
            "burst_extra": args.extra,
            "size": args.size,
            "num_inference_steps": args.steps,
            "model": str(args.model or "bundled demo model"),
            "request_mix": "the demo fixtures in turn (0-4 references), seed = request index",
        },
        **summarize(load, series, args),
        "server_metrics": [
            line
            for line in metrics_text.splitlines()
            if line.startswith(
                (
                    "ditq_requests_total",
                    "ditq_out_of_memory_total",
                    "ditq_dropped_requests_total",
                    "ditq_collapsed_outputs_total",
                    "ditq_peak_resident_memory_bytes",
                )
            )
        ],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("steady", "burst", "criteria", "passed")}, indent=1))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
