"""Where the report's numbers come from: ditq's version and revision, libraries, device, commands."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import ditq

__all__ = ["LIBRARIES", "device_description", "git_revision", "library_versions", "shell_command"]

LIBRARIES = (
    "torch",
    "diffusers",
    "compressed-tensors",
    "transformers",
    "safetensors",
    "numpy",
    "pillow",
    "matplotlib",
    "pydantic",
    "fastapi",
    "uvicorn",
    "httpx",
)


def library_versions() -> dict[str, str]:
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def git_revision() -> str | None:
    """The revision of the checkout ditq runs from (``+dirty`` with uncommitted changes); None if not one."""
    source = Path(ditq.__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "-C", str(source), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def device_description() -> str:
    """The accelerator this process sees, or the CPU."""
    try:
        import torch

        if torch.cuda.is_available():
            index = torch.cuda.current_device()
            props = torch.cuda.get_device_properties(index)
            return f"{props.name} (sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB)"
    except ImportError:
        pass
    return f"CPU {platform.machine()} ({os.cpu_count()} cores)"


def shell_command(argv: Sequence[str] | None = None) -> str:
    """A command line as a person would type it: ``ditq ...`` for ditq's entry point and for
    ``PYTHON -m ditq.cli ...``; this process's own command line when ``argv`` is None."""
    argv = list(sys.argv if argv is None else argv)
    if argv[1:3] == ["-m", "ditq.cli"]:
        argv = ["ditq", *argv[3:]]
    elif argv and argv[0].endswith(("ditq", "cli.py", "__main__.py")):
        argv[0] = "ditq"
    return shlex.join(argv)
