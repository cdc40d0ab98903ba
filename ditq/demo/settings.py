"""The demo's sweep settings (``ditq demo``) and its fixtures: what ``ditq demo`` and ``ditq plan`` on the bundled
model run by default."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ditq.fsutil import atomic_write_bytes, user_cache_dir
from ditq.jsonfile import read_json

__all__ = ["DEMO", "DemoSettings", "demo_fixtures"]


@dataclass(frozen=True)
class DemoSettings:
    """The demo's settings. Fewer denoising steps than the probe's default 20 keep the whole sweep
    (baseline + three schemes x 16 requests) within minutes on two CPU cores."""

    schemes: tuple[str, ...] = ("w8a16", "w8a8", "fp8")
    seeds: str = "2301-2304"
    steps: int = 8
    # Two-core CPUs without bfloat16 matrix units run BF16 many times slower than float32: the demo's
    # "BF16" baseline and the quantized models' unquantized parts compute in float32 there.
    dtype: str = "float32"
    # The seed's capacity matrix: one fixture each for 1, 2, 3 and 4 reference images (the bundled
    # text-to-image fixture is left out of the demo's sweep).
    references: tuple[int, ...] = (1, 2, 3, 4)
    # The parity band, measured in every demo: the baseline (the model served in float32) against the same
    # model run in process in bfloat16, per fixture and seed (benchmarks/demo_parity.py measured the same pair:
    # 50.1-57.3 dB per fixture, mean over 4 seeds). Compare's 1 dB tolerance applies below it.
    parity_in_process: bool = True


DEMO = DemoSettings()


def demo_fixtures(folder: Path | None = None) -> Path:
    """The bundled fixtures with DEMO.references references, written (unchanged if present) under ``folder``:
    by default ditq's cache (``user_cache_dir()/demo``), apart from the demo's output, which may not hold its own
    inputs (``ditq.fsutil.check_output``)."""
    from ditq import demo

    out = folder if folder is not None else user_cache_dir() / "demo"

    bundled = read_json(demo.fixtures_path())
    chosen = {k: v for k, v in bundled.items() if len(v.get("references") or []) in DEMO.references}
    path = out / "demo-fixtures.json"
    text = json.dumps(chosen, indent=1) + "\n"
    if not path.is_file() or path.read_text() != text:
        atomic_write_bytes(path, text.encode())
    return path
