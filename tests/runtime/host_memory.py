"""Measuring a loader's host memory in a fresh interpreter: ``measure`` runs a script that starts with ``status``
(a field of /proc/self/status in bytes: ``status("VmRSS")``, ``status("VmHWM")``) and prints its figures as JSON."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

__all__ = ["measure"]

_STATUS = textwrap.dedent(
    """
    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024  # the kernel writes kB
        raise KeyError(key)
    """
)


def measure(script: str, *args: str) -> dict[str, Any]:
    """``script`` (with ``status`` defined) run as ``python -c`` with ``args``; the JSON object its last line prints."""
    done = subprocess.run(
        [sys.executable, "-c", _STATUS + script, *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    measured: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return measured
