"""Where a whole pipeline's memory goes, stage by stage, and what each memory reduction costs in time and fidelity.

For each model directory (a BF16 source or a ditq artifact), in process on one device with nothing offloaded, every
fixture runs once per seed through ``ditq.runtime.adapter.PipelineAdapter``, whose stage clock records the peak
allocated bytes of each request stage (text encoding, image encoding, the first denoising step that fills the
prefix KV cache, the later steps, decoding) and what was allocated when the request began. Then each reduction
runs the same requests, and its images are compared with the untouched path's (PSNR, dB):

- ``cache-held``: the prefix KV cache held to the end of the call, as the pipeline holds it, instead of let go
  when the VAE begins decoding (``ditq.runtime.prefix_release``): what the release saves (the images are the same);
- ``vae-tiling``: the VAE decodes (and encodes) in tiles (diffusers' ``enable_tiling``);
- ``kv-int8`` / ``kv-fp8``: the prefix KV cache of the text and reference tokens kept in 8 bits
  (``ditq.runtime.kv_cache``);
- ``keep-unused``: the same artifact with the modules its manifest declares unused loaded and run (a text
  encoder's ``lm_head``): what dropping them saves, in bytes and milliseconds.

With ``--against SOURCE`` every image is also compared with SOURCE's (run first, untouched), and each variant's
summary gives its mean PSNR against SOURCE next to the untouched path's: what the reduction costs a candidate's
fidelity to its baseline, in dB.

Usage (the H200 run: ``benchmarks/h200_whole_pipeline.sh``; the demo model on a CPU):
    python benchmarks/pipeline_memory.py --model DIR [--model ART ...] --fixtures F.json --refs DIR
        [--seeds 2301] [--steps 10] [--device cuda] [--variants base,cache-held,vae-tiling,kv-int8,kv-fp8,keep-unused]
        --out results.json
    ditq quantize ditq/demo/model demo-w8a8 --scheme w8a8
    python benchmarks/pipeline_memory.py --against ditq/demo/model --model demo-w8a8 \\
        --fixtures ditq/demo/fixtures.json --refs ditq/demo/references --seeds 2301-2308 --steps 8 --device cpu \\
        --variants base,kv-int8,kv-fp8 --out benchmarks/results/kv_cache_demo_cpu_COMMIT.json
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from ditq.devices import resolve_device, resolve_dtype
from ditq.metrics import psnr
from ditq.pipeline.open import load_pipeline
from ditq.probe.fixtures import load_fixtures, parse_seeds
from ditq.runtime.adapter import GenerationRequest, PipelineAdapter

VARIANTS = ("base", "cache-held", "vae-tiling", "kv-int8", "kv-fp8", "keep-unused")


def _commit() -> str | None:
    if os.environ.get("DITQ_SOURCE_COMMIT"):
        return os.environ["DITQ_SOURCE_COMMIT"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _load(model: Path, device: torch.device, dtype: torch.dtype, keep_unused: bool) -> PipelineAdapter:
    from ditq.doctor import kernel_chooser

    pipeline = load_pipeline(
        model, device=device, dtype=dtype, chooser=kernel_chooser(), drop_unused=not keep_unused
    )
    return PipelineAdapter(pipeline)


def _requests(fixtures_file: Path, refs: Path, seeds: list[int], steps: int) -> list[tuple[str, int, Any]]:
    fixtures = load_fixtures(fixtures_file, refs)
    out = []
    for fixture in fixtures.values():
        images = [Image.open(p).convert("RGBA") for p in fixture.reference_paths]
        for seed in seeds:
            request = GenerationRequest(
                prompt=fixture.prompt,
                images=images,
                width=fixture.width,
                height=fixture.height,
                num_inference_steps=steps,
                seed=seed,
            )
            out.append((fixture.id, seed, request))
    return out


def _run(
    adapter: PipelineAdapter, requests: list[tuple[str, int, Any]], device: torch.device, warmed: set[int]
) -> dict[str, Any]:
    """Every request once, after one warm-up per reference count the adapter has not run yet (``warmed``):
    timings, stage memory, PNG bytes."""
    rows = []
    for fixture_id, seed, request in requests:
        if len(request.images) not in warmed:
            adapter(request)
            warmed.add(len(request.images))
        result = adapter(request)
        buffer = io.BytesIO()
        result.images[0].save(buffer, format="PNG")
        rows.append(
            {
                "fixture": fixture_id,
                "seed": seed,
                "references": len(request.images),
                "timings_s": result.timings,
                "step_s": result.step_times,
                "peak_bytes": result.peak_memory_bytes,
                "stage_peak_bytes": result.stage_peak_memory_bytes,
                "start_bytes": result.memory_at_start_bytes,
                "png": buffer.getvalue(),
            }
        )
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"rows": rows}


def _apply(adapter: PipelineAdapter, variant: str) -> Any:
    """Switch ``variant`` on; returns what switches it off."""
    pipeline = adapter.pipeline
    if variant == "vae-tiling":
        pipeline.vae.enable_tiling()
        return pipeline.vae.disable_tiling
    if variant == "cache-held":
        adapter.release_prefix_cache = False
        return lambda: setattr(adapter, "release_prefix_cache", True)
    if variant in ("kv-int8", "kv-fp8"):
        from ditq.runtime.kv_cache import install_kv_cache

        handle = install_kv_cache(pipeline, variant.removeprefix("kv-"))
        return handle.remove
    return lambda: None


def _psnr(png: bytes, reference: bytes) -> float:
    a = np.asarray(Image.open(io.BytesIO(png)))
    b = np.asarray(Image.open(io.BytesIO(reference)))
    return float(psnr(a, b))


def _summary(
    rows: list[dict[str, Any]], base: list[dict[str, Any]] | None, against: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """The rows without their PNGs, each compared with the same (fixture, seed) of ``base`` and ``against``."""

    def find(rows_of: list[dict[str, Any]], row: dict[str, Any]) -> bytes:
        return next(r["png"] for r in rows_of if (r["fixture"], r["seed"]) == (row["fixture"], row["seed"]))

    out = []
    for row in rows:
        entry = {k: v for k, v in row.items() if k != "png"}
        if base is not None:
            entry["psnr_db_vs_base"] = _psnr(row["png"], find(base, row))
        if against is not None:
            entry["psnr_db_vs_against"] = _psnr(row["png"], find(against, row))
        out.append(entry)
    return out


def _mean_finite(values: list[float]) -> float | None:
    finite = [v for v in values if np.isfinite(v)]
    return round(float(np.mean(finite)), 3) if finite else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, action="append", required=True)
    parser.add_argument(
        "--against", type=Path, help="a source model whose untouched images every image is compared with"
    )
    parser.add_argument("--fixtures", type=Path, required=True)
    parser.add_argument("--refs", type=Path, required=True)
    parser.add_argument("--seeds", default="2301")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument(
        "--variant-fixtures",
        default="",
        help="comma list: the reductions run these fixtures only (base runs all)",
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown or variants[:1] != ["base"]:
        parser.error(f"--variants: start with base, from {', '.join(VARIANTS)} (unknown: {unknown})")
    requests = _requests(args.fixtures, args.refs, parse_seeds(args.seeds), args.steps)
    variant_fixtures = {f for f in args.variant_fixtures.split(",") if f}
    results: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "commit": _commit(),
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "dtype": str(dtype).removeprefix("torch."),
        "steps": args.steps,
        "models": {},
    }
    against = None
    if args.against is not None:
        reference = _load(args.against, device, dtype, keep_unused=False)
        against = _run(reference, requests, device, set())["rows"]
        results["against"] = {"model": str(args.against), "rows": _summary(against, None, None)}
        del reference
        gc.collect()
    for model in args.model:
        started = time.perf_counter()
        adapter = _load(model, device, dtype, keep_unused=False)
        entry: dict[str, Any] = {
            "load_s": round(time.perf_counter() - started, 2),
            "unused": dict(getattr(adapter.pipeline, "ditq_unused", {})),
            "allocated_after_load_bytes": int(torch.cuda.memory_allocated(device))
            if device.type == "cuda"
            else None,
            "variants": {},
        }
        base: list[dict[str, Any]] | None = None
        warmed: set[int] = set()
        for variant in variants:
            if variant == "keep-unused":
                if not entry["unused"]:
                    continue
                del adapter
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                adapter = _load(model, device, dtype, keep_unused=True)
                entry["allocated_after_load_keep_unused_bytes"] = (
                    int(torch.cuda.memory_allocated(device)) if device.type == "cuda" else None
                )
            if variant == "vae-tiling" and not callable(
                getattr(getattr(adapter.pipeline, "vae", None), "enable_tiling", None)
            ):
                continue
            if variant.startswith("kv-") and not getattr(
                getattr(adapter.pipeline.transformer, "config", None), "causal_condition", False
            ):
                continue
            if variant == "keep-unused":
                warmed = set()
            undo = _apply(adapter, variant)
            chosen = requests if variant == "base" or not variant_fixtures else [
                r for r in requests if r[0] in variant_fixtures
            ]  # fmt: skip
            rows = _run(adapter, chosen, device, warmed)["rows"]
            undo()
            entry["variants"][variant] = _summary(rows, base, against)
            if against is not None:
                summary = entry["variants"][variant]
                keys = {(r["fixture"], r["seed"]) for r in summary}
                mean = _mean_finite([r["psnr_db_vs_against"] for r in summary])
                untouched = _mean_finite(
                    [
                        r["psnr_db_vs_against"]
                        for r in entry["variants"]["base"]
                        if (r["fixture"], r["seed"]) in keys
                    ]
                )
                entry.setdefault("psnr_db_vs_against", {})[variant] = {
                    "mean": mean,
                    "untouched_mean_same_requests": untouched,
                    "cost_db": None if mean is None or untouched is None else round(untouched - mean, 3),
                }
            if variant == "base":
                base = rows
            print(f"{model.name} {variant}: done", flush=True)
        results["models"][str(model)] = entry
        del adapter
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
