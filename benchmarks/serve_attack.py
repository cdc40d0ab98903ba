"""Soak test of `ditq serve` under hostile traffic on loopback (issue 15): what it holds and whether it answers.

    python benchmarks/serve_attack.py --out benchmarks/results/serve_attack_after_cpu_COMMIT.json
    python benchmarks/serve_attack.py --repo /tmp/ditq-before --label before \\
        --out benchmarks/results/serve_attack_before_cpu_COMMIT.json     # the code before the hardening, same phases

Starts `ditq serve` (the bundled demo model, float32, --request-timeout 30) from ``--repo`` as a subprocess on a
free loopback port. Throughout, one well-behaved client sends a small generation (64x64, 2 steps) as soon as
the previous one is answered, and /health is asked every 0.5 s (2 s timeout). Phases, in order:

- baseline: nothing else.
- slow_body: ``--slow-bodies`` connections each declare a 48 MiB body (half JSON, half multipart), send
  ``--slow-mib`` MiB of it at once and then stall.
- image_bomb: four concurrent edits, each uploading one 9400x9400 PNG (just under Pillow's bomb limit),
  again as soon as answered.
- over_cost: one generation inside every fixed limit that the CPU cannot finish (512x512, 200 steps, n=4).
- idle: ``--idle`` connections that connect and send nothing.
- forged_metrics: 200 requests whose URL-decoded path carries a Prometheus line, over the body limit.

Every 0.5 s the server's resident memory and the sockets it holds (/proc/PID) are sampled, and the established
connections on its port as the kernel counts them (/proc/net/tcp: these include the listen queue). A flood of
connections is accepted in one burst before any is closed, so the maximum of held sockets shows that burst;
the median shows what stays held. Per phase the JSON records those (max, last), /health probes answered and their worst
latency, the well-behaved client's answers by status, the attack's answers by status, and the log bytes the
server wrote. The JSON also records the command, git commit, versions and the server command.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from PIL import Image

from ditq.sweep.health import wait_healthy

sys.path.insert(0, str(Path(__file__).resolve().parent))
from result_names import result_path
from serve_load import free_port, git_commit, rss_bytes

REPO = Path(__file__).resolve().parents[1]
GOOD = {"prompt": "a red circle on a white background", "size": "64x64", "num_inference_steps": 2, "seed": 0}
OVER_COST = {"prompt": "a city at night", "size": "512x512", "num_inference_steps": 200, "n": 4}
FORGED = "/v1/x%22%7D%201%0Aditq_out_of_memory_total%2099999%0A%23"
PART_HEAD = b'--b\r\ncontent-disposition: form-data; name="image"; filename="a.png"\r\ncontent-type: image/png\r\n\r\n'


def held_sockets(pid: int) -> int | None:
    """Sockets the server process holds open (accepted connections, its listener, its own clients)."""
    try:
        return sum(
            os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:") for fd in os.listdir(f"/proc/{pid}/fd")
        )
    except OSError:
        return None


def established(port: int) -> int:
    """Established TCP connections on the server's ``port`` as the kernel counts them: the process's and those
    still waiting in the listen queue to be accepted."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "01":
                count += 1
    return count


class Watch:
    """Samples memory and connections, probes /health and runs the well-behaved client, tagged by phase."""

    def __init__(self, base: str, port: int, pid: int, log_path: Path) -> None:
        self.base, self.port, self.pid, self.log_path = base, port, pid, log_path
        self.phase = "start"
        self.stop = threading.Event()
        self.samples: list[dict[str, Any]] = []
        self.probes: list[dict[str, Any]] = []
        self.good: list[dict[str, Any]] = []
        self.attack: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.threads = [
            threading.Thread(target=f, daemon=True) for f in (self._sample, self._probe, self._client)
        ]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def _sample(self) -> None:
        while not self.stop.wait(0.5):
            self.samples.append(
                {
                    "phase": self.phase,
                    "rss": rss_bytes(self.pid),
                    "held": held_sockets(self.pid),
                    "established": established(self.port),
                }
            )

    def _probe(self) -> None:
        while not self.stop.wait(0.5):
            phase, started = self.phase, time.perf_counter()
            try:
                status: int | str = httpx.get(f"{self.base}/health", timeout=2.0).status_code
            except httpx.HTTPError as error:
                status = type(error).__name__
            self.probes.append({"phase": phase, "status": status, "seconds": time.perf_counter() - started})

    def _client(self) -> None:
        while not self.stop.is_set():
            phase, started = self.phase, time.perf_counter()
            try:
                status: int | str = httpx.post(
                    f"{self.base}/v1/images/generations", json=GOOD, timeout=35
                ).status_code
            except httpx.HTTPError as error:
                status = type(error).__name__
            self.good.append({"phase": phase, "status": status, "seconds": time.perf_counter() - started})
            self.stop.wait(0.5)

    def record_attack(self, status: int | str) -> None:
        with self.lock:
            self.attack.append({"phase": self.phase, "status": status})

    def summary(self, phase: str, log_bytes: int, seconds: float) -> dict[str, Any]:
        samples = [s for s in self.samples if s["phase"] == phase]
        rss = [s["rss"] for s in samples if s["rss"] is not None]
        held = [s["held"] for s in samples if s["held"] is not None]
        probes = [p for p in self.probes if p["phase"] == phase]
        good = [g for g in self.good if g["phase"] == phase]
        return {
            "seconds": round(seconds, 1),
            "rss_mib_max": round(max(rss) / 2**20, 1) if rss else None,
            "rss_mib_last": round(rss[-1] / 2**20, 1) if rss else None,
            "held_sockets_max": max(held, default=None),
            "held_sockets_median": statistics.median(held) if held else None,
            "established_max": max((s["established"] for s in samples), default=None),
            "health_answered": f"{sum(p['status'] in (200, 503) for p in probes)}/{len(probes)}",
            "health_seconds_max": round(max((p["seconds"] for p in probes), default=0.0), 3),
            "good_requests": dict(Counter(str(g["status"]) for g in good)),
            "good_seconds_median": round(statistics.median(g["seconds"] for g in good), 3) if good else None,
            "attack_answers": dict(Counter(str(a["status"]) for a in self.attack if a["phase"] == phase)),
            "log_bytes": log_bytes,
        }


def read_status(sock: socket.socket, timeout: float) -> int | str:
    """The status code of the first response on ``sock``, or what happened instead."""
    sock.settimeout(timeout)
    try:
        head = sock.recv(64)
    except TimeoutError:
        return "no answer"
    except OSError as error:
        return type(error).__name__
    if not head:
        return "closed"
    return int(head.split()[1]) if head.startswith(b"HTTP/1.1 ") else "garbage"


def slow_bodies(watch: Watch, count: int, mib: int, seconds: float) -> None:
    sockets = []
    for index in range(count):
        kind, path = (
            ("application/json", "generations") if index % 2 else ("multipart/form-data; boundary=b", "edits")
        )
        try:
            sock = socket.create_connection(("127.0.0.1", watch.port), timeout=10)
            sock.sendall(
                f"POST /v1/images/{path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: {kind}\r\n"
                f"content-length: {48 * 2**20}\r\n\r\n".encode()
                + (b"" if index % 2 else PART_HEAD)
            )
            sock.settimeout(5)
        except OSError as error:
            watch.record_attack(type(error).__name__)
            continue
        try:
            sock.sendall(b"x" * (mib * 2**20))
        except OSError:  # answered (413) and closed before the body was in
            watch.record_attack(read_status(sock, 1))
            sock.close()
            continue
        sockets.append(sock)
    time.sleep(seconds)
    for sock in sockets:
        watch.record_attack(read_status(sock, 0.5))
        sock.close()


def bomb_png() -> bytes:
    image = Image.new("RGB", (9400, 9400), (30, 120, 200))
    image.paste((200, 40, 40), (1000, 1000, 8000, 8000))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def image_bombs(watch: Watch, seconds: float, png: bytes) -> None:
    deadline = time.perf_counter() + seconds

    def one_client() -> None:
        while time.perf_counter() < deadline:
            try:
                status: int | str = httpx.post(
                    f"{watch.base}/v1/images/edits",
                    data={"prompt": "make it blue", "size": "64x64", "num_inference_steps": "2"},
                    files=[("image[]", ("bomb.png", png, "image/png"))],
                    timeout=60,
                ).status_code
            except httpx.HTTPError as error:
                status = type(error).__name__
            watch.record_attack(status)

    threads = [threading.Thread(target=one_client) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def over_cost(watch: Watch, seconds: float) -> None:
    def send() -> None:
        try:
            status: int | str = httpx.post(
                f"{watch.base}/v1/images/generations", json=OVER_COST, timeout=seconds
            ).status_code
        except httpx.HTTPError as error:
            status = type(error).__name__
        watch.record_attack(status)

    thread = threading.Thread(target=send)
    thread.start()
    thread.join(seconds + 5)


def idle_connections(watch: Watch, count: int, seconds: float) -> None:
    sockets = []
    for _ in range(count):
        try:
            sockets.append(socket.create_connection(("127.0.0.1", watch.port), timeout=2))
        except OSError as error:
            watch.record_attack(type(error).__name__)
    time.sleep(seconds)
    closed_by_server = 0
    for sock in sockets:
        sock.setblocking(False)
        try:
            closed_by_server += sock.recv(1) == b""
        except BlockingIOError:
            pass
        except OSError:
            closed_by_server += 1
        sock.close()
    watch.record_attack(f"{closed_by_server} of {len(sockets)} closed by the server")


def forged_metrics(watch: Watch) -> dict[str, Any]:
    for index in range(200):
        try:
            with socket.create_connection(("127.0.0.1", watch.port), timeout=5) as sock:
                sock.sendall(
                    f"POST {FORGED}{index} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                    f"content-length: {80 * 2**20}\r\n\r\n".encode()
                )
                watch.record_attack(read_status(sock, 5))
        except OSError as error:
            watch.record_attack(type(error).__name__)
    text = httpx.get(f"{watch.base}/metrics", timeout=10).text
    return {
        "metrics_bytes": len(text),
        "forged_line_present": any(
            line.startswith("ditq_out_of_memory_total 99999") for line in text.splitlines()
        ),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--repo", type=Path, default=REPO, help="the checkout whose ditq serves (default: this one)"
    )
    parser.add_argument("--label", default="after")
    parser.add_argument("--phase-seconds", type=float, default=25.0)
    parser.add_argument("--slow-bodies", type=int, default=60)
    parser.add_argument("--slow-mib", type=int, default=24)
    parser.add_argument("--idle", type=int, default=4000)
    parser.add_argument("--serve-arg", action="append", default=[], help="extra argument for ditq serve")
    parser.add_argument("--out", type=Path, default=result_path("serve_attack_after", "cpu"))
    args = parser.parse_args()

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    png = bomb_png()
    port = free_port()
    command = [
        sys.executable, "-m", "ditq.cli", "serve", "--port", str(port), "--dtype", "float32",
        "--request-timeout", "30", *args.serve_arg,
    ]  # fmt: skip
    log_path = Path(tempfile.mkstemp(prefix="serve_attack-", suffix=".log")[1])
    environment = {**os.environ, "PYTHONPATH": str(args.repo.resolve())}
    with log_path.open("w") as log:
        server = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, cwd=args.repo, env=environment
        )
    base = f"http://127.0.0.1:{port}"
    phases: dict[str, Any] = {}
    try:
        problem = wait_healthy(base, 300, server)
        if problem is not None:
            raise SystemExit(f"ditq serve: {problem}; see {log_path}")
        watch = Watch(base, port, server.pid, log_path)
        watch.start()
        attacks = [
            ("baseline", lambda: time.sleep(args.phase_seconds / 2)),
            ("slow_body", lambda: slow_bodies(watch, args.slow_bodies, args.slow_mib, args.phase_seconds)),
            ("image_bomb", lambda: image_bombs(watch, args.phase_seconds, png)),
            ("over_cost", lambda: over_cost(watch, args.phase_seconds + 10)),
            ("idle", lambda: idle_connections(watch, args.idle, args.phase_seconds)),
        ]
        for name, attack in attacks:
            watch.phase, started, log_before = name, time.perf_counter(), log_path.stat().st_size
            attack()
            time.sleep(2)  # what the attack leaves behind is part of its phase
            phases[name] = watch.summary(
                name, log_path.stat().st_size - log_before, time.perf_counter() - started
            )
            print(name, json.dumps(phases[name]), flush=True)
        watch.phase, log_before, started = "forged_metrics", log_path.stat().st_size, time.perf_counter()
        forged = forged_metrics(watch)
        phases["forged_metrics"] = {
            **watch.summary(
                "forged_metrics", log_path.stat().st_size - log_before, time.perf_counter() - started
            ),
            **forged,
        }
        watch.stop.set()
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    result = {
        "benchmark": "serve_attack",
        "label": args.label,
        "command": "python benchmarks/serve_attack.py " + " ".join(sys.argv[1:]),
        "server_command": "ditq serve " + " ".join(command[4:]),
        "served_code": {"repo": str(args.repo), "git_commit": git_commit(args.repo)},
        "benchmark_git_commit": git_commit(REPO),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "environment": {
            **environment(),
            "open_files_limit": [soft, hard],
            "note": "CPU only, two cores shared with other work: latencies are indicative",
        },
        "settings": {
            "phase_seconds": args.phase_seconds,
            "slow_bodies": args.slow_bodies,
            "slow_mib_each": args.slow_mib,
            "idle_connections": args.idle,
            "good_request": GOOD,
            "over_cost_request": OVER_COST,
            "bomb_png_bytes": len(png),
        },
        "phases": phases,
        "server_log_bytes": log_path.stat().st_size,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(phases, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
