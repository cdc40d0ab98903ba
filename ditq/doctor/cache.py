"""Where the doctor ran (the environment a report states and a cached verdict is keyed by) and the cache
of verdicts: per (device, driver, library versions, the code a verdict depends on, path, geometries, settings),
under the user cache directory (``DITQ_CACHE_DIR`` overrides)."""

from __future__ import annotations

import functools
import hashlib
import json
import platform
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

import ditq
from ditq.doctor.cases import Geometry
from ditq.fsutil import user_cache_dir
from ditq.kernels.registry import KernelPath
from ditq.runfiles import DoctorEnvironment, DoctorPath, read_model, write_model

__all__ = ["cache_dir", "cache_entry", "code_digest", "environment", "read_cached", "write_cached"]

# What a verdict depends on besides the environment: the kernels, the checks, and the stored layout and numerics
# they are checked against (ditq's version alone does not move when these do)
_VERDICT_CODE = ("kernels", "doctor", "checkpoint/codecs.py", "numerics.py")


def _driver_version() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # no NVIDIA driver or no NVML: recorded as unknown
        return None


def _package_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def environment(device: torch.device | str) -> DoctorEnvironment:
    """What a report must say about where it ran."""
    device = torch.device(device)
    env: dict[str, str | None] = {
        "device": str(device),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _package_version("triton"),
        "ditq": ditq.__version__,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, capability=".".join(map(str, torch.cuda.get_device_capability(device))),
                   driver=_driver_version())  # fmt: skip
    else:
        env.update(gpu=None, capability=None, driver=None, cpu=platform.processor() or platform.machine())
    return DoctorEnvironment.model_validate(env)


def cache_dir() -> Path:
    """Where verdicts are cached: ditq's cache folder ($DITQ_CACHE_DIR, else the user cache directory)."""
    return user_cache_dir()


@functools.cache
def code_digest() -> str:
    """sha256 over ditq's source files a verdict depends on (``_VERDICT_CODE``), by their paths and bytes: a
    changed kernel is checked again rather than vouched for by a verdict on the code it replaced."""
    root = Path(ditq.__file__).parent
    digest = hashlib.sha256()
    for name in _VERDICT_CODE:
        found = root / name
        for file in sorted(found.rglob("*.py")) if found.is_dir() else [found]:
            digest.update(file.relative_to(root).as_posix().encode() + b"\0" + file.read_bytes() + b"\0")
    return digest.hexdigest()


def cache_entry(
    env: DoctorEnvironment, path: KernelPath, geometries: Sequence[Geometry], settings: Mapping[str, Any]
) -> Path:
    """The file that holds ``path``'s verdict for these geometries and settings in this environment."""
    keyed = {
        k: getattr(env, k) for k in ("gpu", "capability", "driver", "cuda", "torch", "triton", "ditq", "cpu")
    }
    blob = json.dumps(
        [keyed, code_digest(), path.name, [str(g) for g in geometries], dict(settings)],
        sort_keys=True,
        default=str,
    )
    return cache_dir() / "doctor" / f"{hashlib.sha256(blob.encode()).hexdigest()[:24]}.json"


def read_cached(entry: Path) -> DoctorPath:
    return read_model(DoctorPath, entry)


def write_cached(entry: Path, result: DoctorPath) -> None:
    entry.parent.mkdir(parents=True, exist_ok=True)
    write_model(entry, result)
