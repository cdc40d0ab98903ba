"""diffusers' step caches (``--cache``) on the demo model: what each setting skips and what it costs in fidelity.

    python benchmarks/step_cache_fidelity.py --out benchmarks/results/step_cache_fidelity_cpu_COMMIT.json

Every fixture of the demo (its references, under the prefix KV cache), seeds 2301-2303 (``--seeds``), 8 steps, on
the CPU in float32, in process: the unquantized model without a step cache is the reference. For the unquantized
model and for the transformer quantized in memory (``ditq.quantize_``: fp8 and w8a8), each step cache setting
(``ditq.runtime.step_cache``, installed and removed on the same quantized model) runs the same requests. Per row: the
mean skipped steps per request, mean PSNR and SSIM over every image against the reference, the mean PSNR per seed
(over the fixtures) with its bootstrap interval, the same against the scheme without a step cache (what the cache
alone costs), and the median seconds per request (a shared CPU: read it as a ratio to the row without a cache).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from four_bit_fidelity import demo_requests, fidelity_scores, write_result
from result_names import result_path

SEEDS = "2301-2303"
STEPS = 8
SCHEMES = (None, "fp8", "w8a8")  # None: the unquantized model
# None, the thresholds ``ditq sweep --cache auto`` tries (ditq.sweep.step_cache.AUTO_SETTINGS), and TaylorSeer
SETTINGS = (None, "first-block:0.2", "first-block:0.4", "first-block:0.6", "taylorseer:2")


def _adapter(scheme: str | None):  # type: ignore[no-untyped-def]
    from ditq import demo
    from ditq.pipeline.open import open_pipeline
    from ditq.quantization.in_memory import quantize_
    from ditq.runtime.options import LoadOptions, resolve_load_options

    load = resolve_load_options(LoadOptions(device="cpu", dtype="float32", skip_doctor=True))
    adapter = open_pipeline(demo.default_model_dir(), load)
    if scheme is not None:
        quantize_(adapter.pipeline, scheme)
    return adapter


def _run(adapter, requests):  # type: ignore[no-untyped-def]
    """key -> (RGBA pixels, skipped steps, seconds)."""
    out = {}
    for key, request in requests.items():
        began = time.perf_counter()
        result = adapter(request)
        out[key] = (
            np.asarray(result.images[0].convert("RGBA")),
            result.skipped_steps or 0,
            time.perf_counter() - began,
        )
    return out


def _scores(results, against, fixtures, seeds) -> dict:  # type: ignore[no-untyped-def,type-arg]
    return fidelity_scores({key: value[0] for key, value in results.items()}, against, fixtures, seeds)[0]


def _write(args, seeds, fixtures, rows, started) -> None:  # type: ignore[no-untyped-def]
    write_result(
        "step_cache_fidelity.py",
        args,
        {
            "what": "demo model (prefix KV cache on), transformer quantized in memory or not, a diffusers step cache "
            "installed per row; PSNR/SSIM against the unquantized float32 run without a step cache, and against "
            "the same scheme without one",
            "steps": STEPS,
            "seeds": list(seeds),
            "fixtures": list(fixtures),
            "rows": rows,
            "complete": len(rows)
            == len(SCHEMES) * len(SETTINGS),  # False: the run stopped before its last row
            "total_seconds": round(time.time() - started, 1),
        },
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default=SEEDS, help="the judged seeds (default %(default)s)")
    parser.add_argument("--out", type=Path, default=result_path("step_cache_fidelity", "cpu"))
    args = parser.parse_args()
    from ditq.probe.fixtures import parse_seeds
    from ditq.runtime.step_cache import install_step_cache

    seeds = tuple(parse_seeds(args.seeds))
    requests = demo_requests(seeds)
    fixtures = list(dict.fromkeys(fixture_id for fixture_id, _ in requests))  # in the fixtures file's order
    started = time.time()
    rows: dict[str, dict] = {}  # type: ignore[type-arg]
    reference: dict[tuple[str, int], np.ndarray] = {}
    for scheme in SCHEMES:
        adapter = _adapter(scheme)
        uncached: dict[tuple[str, int], np.ndarray] = {}
        for setting in SETTINGS:
            run = None if setting is None else install_step_cache(adapter.pipeline, setting)
            results = _run(adapter, requests)
            if run is not None:
                run.remove()
            if setting is None:
                uncached = {key: value[0] for key, value in results.items()}
                reference = reference or uncached
            name = f"{scheme or 'float32'} {setting or 'no cache'}"
            rows[name] = {
                "scheme": scheme,
                "cache": setting,
                "skipped_steps_mean": round(float(np.mean([v[1] for v in results.values()])), 2),
                "steps": STEPS,
                "against_unquantized_uncached": _scores(results, reference, fixtures, seeds),
                "against_scheme_uncached": _scores(results, uncached, fixtures, seeds),
                "seconds_per_request_median": round(statistics.median(v[2] for v in results.values()), 3),
            }
            row = rows[name]
            _write(args, seeds, fixtures, rows, started)  # after every row: an interrupted run keeps its rows
            print(
                f"{name:<28} skipped {row['skipped_steps_mean']:4.2f}/{STEPS}  PSNR "
                f"{row['against_unquantized_uncached']['psnr_db']:6.2f} dB "
                f"{row['against_unquantized_uncached']['psnr_db_interval']}  SSIM "
                f"{row['against_unquantized_uncached']['ssim']:.4f}  {row['seconds_per_request_median']:.3f} s",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
