"""Synthetic run directories in the run-directory contract: real PNGs (PIL), real records, gate and compare JSON.

The images are seeded patterns: the baseline draws a smooth scene per (fixture, seed); a
"healthy" candidate adds small seeded noise to it; a "collapsed" candidate writes transparent
horizontal stripes (the seed's broken int8 signature).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

FIXTURES = {"fx-one": 1, "fx-two": 2, "fx-three": 3, "fx-four": 4}  # fixture id -> reference count
SEEDS = (2301, 2302)
SIZE = 32


def baseline_pixels(fixture_id: str, seed: int) -> np.ndarray:
    """(SIZE, SIZE, 4) uint8, opaque: a gradient and a disc whose place depends on fixture and seed."""
    rng = np.random.default_rng(seed * 31 + len(fixture_id))
    y, x = np.mgrid[0:SIZE, 0:SIZE]
    cx, cy = rng.integers(8, SIZE - 8, size=2)
    disc = ((x - cx) ** 2 + (y - cy) ** 2) < 36
    image = np.zeros((SIZE, SIZE, 4), np.uint8)
    image[..., 0] = (x * 255 // SIZE).astype(np.uint8)
    image[..., 1] = (y * 255 // SIZE).astype(np.uint8)
    image[..., 2] = np.where(disc, 230, 40)
    image[..., 3] = 255
    return image


def candidate_pixels(kind: str, fixture_id: str, seed: int) -> np.ndarray:
    base = baseline_pixels(fixture_id, seed)
    rng = np.random.default_rng(seed)
    if kind == "healthy":
        noisy = base.astype(np.int16) + rng.integers(-3, 4, size=base.shape)
        noisy[..., 3] = 255
        return np.clip(noisy, 0, 255).astype(np.uint8)
    if kind == "collapsed":
        stripes = np.zeros_like(base)
        stripes[::2, :, :3] = rng.integers(0, 255, size=(SIZE // 2, 1, 3))
        stripes[..., 3] = 20
        return stripes
    raise ValueError(kind)


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10.0 * np.log10(255.0**2 / mse)


@dataclass
class RunSpec:
    label: str
    kind: str  # "baseline" | "healthy" | "collapsed"
    wall_by_refs: dict[int, float]  # mean seconds per image
    scheme: str | None = None
    oom_refs: tuple[int, ...] = ()  # reference counts whose requests run out of memory
    fail_refs: tuple[int, ...] = ()  # reference counts whose requests get a 500
    parity: dict | None = field(default_factory=lambda: {"reference_db": 30.0})
    memory_mib: tuple[float, ...] = ()  # a vram.csv series, one sample a second
    gate: bool = True
    compare: bool = True


def write_run(root: Path, spec: RunSpec, baseline: Path | None = None) -> Path:
    run = root / spec.label
    (run / "images").mkdir(parents=True)
    (run / "RUN.json").write_text(
        json.dumps(
            {"label": spec.label, "scheme": spec.scheme, "command": ["ditq", "probe", "--out", str(run)]}
        )
    )
    records, gate_rows, compare_rows = [], [], []
    for fixture_id, refs in FIXTURES.items():
        for index, seed in enumerate(SEEDS):
            record = {
                "fixture_id": fixture_id,
                "seed": seed,
                "n_references": refs,
                "steps": 4,
                "true_cfg_scale": 1.0,
                "size": f"{SIZE}x{SIZE}",
                "wall_s": None,
                "http": 200,
                "bytes": 0,
                "sha256": None,
                "structure": None,
                "usage": None,
                "metrics": None,
                "error": None,
            }
            if refs in spec.oom_refs:
                record.update(http=503, error="HTTP 503 out_of_memory: CUDA out of memory")
            elif refs in spec.fail_refs:
                record.update(http=500, error="HTTP 500 generation_failed")
            else:
                pixels = baseline_pixels(fixture_id, seed) if spec.kind == "baseline" else None
                if pixels is None:
                    pixels = candidate_pixels(spec.kind, fixture_id, seed)
                path = run / "images" / f"{fixture_id}.s{seed}.png"
                Image.fromarray(pixels, "RGBA").save(path)
                record.update(
                    wall_s=spec.wall_by_refs[refs] + 0.1 * index,
                    bytes=path.stat().st_size,
                    sha256=hashlib.sha256(path.read_bytes()).hexdigest(),
                )
                collapsed = spec.kind == "collapsed"
                gate_rows.append(
                    {
                        "fixture_id": fixture_id,
                        "seed": seed,
                        "passed": not collapsed,
                        "reasons": [
                            "transparent: opaque_fraction 0.0 < 0.5",
                            "banded: banding_score 0.9 > 0.5",
                        ]
                        if collapsed
                        else [],
                    }
                )
                reference_path = (
                    None if baseline is None else baseline / "images" / f"{fixture_id}.s{seed}.png"
                )
                if reference_path is not None and reference_path.is_file():
                    reference = np.asarray(Image.open(reference_path))
                    compare_rows.append(
                        {
                            "fixture_id": fixture_id,
                            "seed": seed,
                            "psnr_db": _psnr(reference, pixels),
                            "ssim": None,
                        }
                    )
            records.append(record)
    (run / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if spec.memory_mib:
        # the probe's sampler format: one row per device and sample; device 1 stays idle
        lines = ["t_unix,device,used_mib,total_mib,process_mib"]
        for i, used in enumerate(spec.memory_mib):
            lines += [f"{1000.0 + i:.3f},0,{used},24576,", f"{1000.0 + i:.3f},1,10,24576,"]
        (run / "vram.csv").write_text("\n".join(lines) + "\n")
    if spec.gate:
        (run / "gate.json").write_text(json.dumps({"records": gate_rows}))
    if spec.compare and baseline is not None:
        (run / "compare.json").write_text(json.dumps({"rows": compare_rows, "parity": spec.parity}))
    return run
