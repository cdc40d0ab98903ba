"""Where a benchmark's result goes by default: ``benchmarks/results/<bench>_<card>_<commit>.json``, so that a rerun
on another card or commit sits beside the committed results instead of replacing one of them."""

from __future__ import annotations

import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def commit() -> str:
    """The checkout's short commit (``ditq.report.provenance.git_revision``), or ``unknown`` outside a git checkout."""
    from ditq.report.provenance import git_revision

    return (git_revision() or "unknown")[:7]


def card(device: str = "cuda") -> str:
    """``cpu``, or the accelerator's short name from its model (``NVIDIA H200`` -> ``h200``)."""
    if device == "cpu":
        return "cpu"
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name()
    found = re.search(r"\b([A-Z]+\d+[A-Za-z]*)\b", name.removeprefix("NVIDIA "))
    return (found.group(1) if found else name.split()[-1]).lower()


def shown_path(out: Path) -> str:
    """``out`` as a result's command shows it: relative to the working directory where it lies inside it, else its
    name alone (no machine's paths in a committed result)."""
    resolved = out.resolve()
    return str(resolved.relative_to(Path.cwd())) if resolved.is_relative_to(Path.cwd()) else out.name


def result_path(bench: str, device: str = "cuda") -> Path:
    """``benchmarks/results/<bench>_<card>_<commit>.json`` for a run on ``device`` (``cpu`` or a GPU)."""
    return RESULTS / f"{bench}_{card(device)}_{commit()}.json"
