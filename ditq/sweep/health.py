"""The servers a sweep starts: a free loopback port, the wait for ``/health``, the stop."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from ditq.errors import EXIT_OUT_OF_MEMORY
from ditq.sweep import launch
from ditq.sweep.options import SweepOptions


def wait_healthy(
    url: str,
    timeout_s: float,
    process: subprocess.Popen[bytes] | launch.Child | None = None,
    interval_s: float = 0.5,
    tick: Callable[[], None] | None = None,
    tick_s: float = 10.0,
) -> str | None:
    """Poll ``url/health`` until it answers 200: None then; otherwise why not (the server `process` exited first,
    or `timeout_s` ran out). Meanwhile ``tick`` every ``tick_s`` seconds (a progress line)."""
    deadline = time.monotonic() + timeout_s
    next_tick = time.monotonic() + tick_s
    while time.monotonic() < deadline:
        if tick is not None and time.monotonic() >= next_tick:
            tick()
            next_tick = time.monotonic() + tick_s
        if process is not None and (code := process.poll()) is not None:
            return f"the server exited with code {code} before it was healthy"
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return None
        except httpx.HTTPError:
            pass
        time.sleep(interval_s)
    return f"the server did not answer /health with 200 within {timeout_s:.0f} s"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def latest_news(log: Path) -> str | None:
    """The last thing a ditq command logged in ``log`` (its ``LEVEL ditq.module: message`` lines; the HTTP access
    lines left out), without the prefix: what a server is doing while it loads and calibrates."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    said = [line.split(": ", 1)[1] for line in lines if line.startswith(_LEVELS) and ": " in line]
    return said[-1][:200] if said else None


_LEVELS = ("INFO ditq", "WARNING ditq", "ERROR ditq")


def last_line(log: Path) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no output"


class Server:
    """A server subprocess on a free loopback port, healthy (/health 200) or stopped and explained."""

    def __init__(self, options: SweepOptions, model: Path, log: Path, offload: str = "none") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = options.serve_argv(model, self.port, options, offload)
        self.log = log
        self.process = launch.start(self.argv, log)

    def wait_healthy(self, timeout_s: float, tick: Callable[[], None] | None = None) -> str | None:
        """None once /health answers 200; otherwise why not (and the server is stopped). ``tick``: a progress
        line every 10 s meanwhile."""
        problem = wait_healthy(self.url, timeout_s, self.process, tick=tick)
        if problem is None:
            return None
        if self.process.poll() is not None:
            return f"{problem} ({last_line(self.log)})"
        self.stop()
        return problem

    @property
    def out_of_memory_at_load(self) -> bool:
        """The server stopped because the model did not fit in the memory it may use."""
        return self.process.poll() == EXIT_OUT_OF_MEMORY

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # drains in-flight work, then exits
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
