"""Wait for an images server to answer ``/health`` with 200 (the sweep, the load benchmark and tests start one)."""

from __future__ import annotations

import subprocess
import time

import httpx

__all__ = ["wait_healthy"]


def wait_healthy(
    url: str, timeout_s: float, process: subprocess.Popen | None = None, interval_s: float = 0.5
) -> str | None:
    """Poll ``url/health`` until it answers 200: None then; otherwise why not (the server `process` exited first,
    or `timeout_s` ran out)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and (code := process.poll()) is not None:
            return f"the server exited with code {code} before it was healthy"
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return None
        except httpx.HTTPError:
            pass
        time.sleep(interval_s)
    return f"the server did not answer /health with 200 within {timeout_s:.0f} s"
