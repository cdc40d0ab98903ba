"""4-bit weights on the demo model: round to nearest against GPTQ, with intervals over seeds.

    python benchmarks/four_bit_fidelity.py --seeds 2301-2308 --out benchmarks/results/four_bit_fidelity_cpu_COMMIT.json

Every fixture of the demo (its references), seeds 2301-2304 (``--seeds``), 8 steps, on the CPU in float32, in
process: the unquantized model's images are the reference. Each row quantizes the transformer in memory
(``ditq.quantize_``) and runs the same requests: w4a16 and w4a8 rounded to nearest and by GPTQ (``--calibrate
gptq``: the fixtures' requests at calibration seeds 0 and 1, 8 steps, never the judged seeds; columns by
decreasing input energy, the default, and in their own order), with w8a8 and fp8 beside them; the ``-channel`` rows
store one scale per output channel (``--group-size channel``) instead of the default groups of 128 (the demo's
Linears take 256 or 768 inputs: two or six groups a row). Per row: mean PSNR and SSIM over every image, the mean per
seed (over the fixtures) with its bootstrap interval, for GPTQ the gain over the same scheme and scales rounded to
nearest, and for one scale per channel the change from groups of 128 rounded the same way, each paired seed by seed. The issue's quality goal: GPTQ at least 3 dB above round to nearest at 4 bits.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from result_names import result_path, shown_path

SEEDS = "2301-2304"
CALIBRATION_SEEDS = (0, 1)
STEPS = 8
# name -> (scheme, calibrate: rtn, gptq (act order, the default) or gptq-in-order, --group-size: None, the scheme's
# own, or "channel")
ROWS: dict[str, tuple[str, str, str | None]] = {
    "w8a8": ("w8a8", "rtn", None),
    "fp8": ("fp8", "rtn", None),
    "w4a16": ("w4a16", "rtn", None),
    "w4a16-gptq-in-order": ("w4a16", "gptq-in-order", None),
    "w4a16-gptq": ("w4a16", "gptq", None),
    "w4a16-channel": ("w4a16", "rtn", "channel"),
    "w4a16-channel-gptq": ("w4a16", "gptq", "channel"),
    "w4a8": ("w4a8", "rtn", None),
    "w4a8-gptq-in-order": ("w4a8", "gptq-in-order", None),
    "w4a8-gptq": ("w4a8", "gptq", None),
    "w4a8-channel": ("w4a8", "rtn", "channel"),
    "w4a8-channel-gptq": ("w4a8", "gptq", "channel"),
}


def _adapter(  # type: ignore[no-untyped-def]
    scheme: str | None, calibrate: str, low_rank: int | None = None, group_size: str | None = None
):
    from ditq import demo
    from ditq.calibration import CalibrationOptions, calibration_for
    from ditq.pipeline.open import open_pipeline
    from ditq.quantization.in_memory import quantize_
    from ditq.runtime.options import LoadOptions, resolve_load_options

    load = resolve_load_options(LoadOptions(device="cpu", dtype="float32", skip_doctor=True))
    adapter = open_pipeline(demo.default_model_dir(), load)
    if scheme is not None:
        calibration = None
        if calibrate.startswith("gptq"):
            options = CalibrationOptions(
                fixtures=demo.fixtures_path(),
                refs=demo.references_dir(),
                seeds=CALIBRATION_SEEDS,
                steps=STEPS,
                act_order=calibrate == "gptq",
            )
            calibration = calibration_for(adapter, options)
        quantize_(adapter.pipeline, scheme, calibration=calibration, low_rank=low_rank, group_size=group_size)
    return adapter


def demo_requests(seeds: tuple[int, ...], steps: int = STEPS) -> dict[tuple[str, int], Any]:
    """Every demo fixture's request at each of ``seeds``, by (fixture id, seed): what these benchmarks judge."""
    from ditq import demo
    from ditq.calibration import fixture_requests
    from ditq.probe.fixtures import load_fixtures

    fixtures = load_fixtures(demo.fixtures_path(), demo.references_dir())
    return {
        (fixture_id, seed): fixture_requests({fixture_id: fixture}, (seed,), steps)[0]
        for fixture_id, fixture in fixtures.items()
        for seed in seeds
    }


def fidelity_scores(
    images: dict[tuple[str, int], np.ndarray],
    against: dict[tuple[str, int], np.ndarray],
    fixtures: list[str],
    seeds: tuple[int, ...],
    per_fixture: bool = False,
) -> tuple[dict[str, Any], dict[int, float]]:
    """(PSNR and SSIM of each image against its reference: their means over every image, the mean PSNR per seed
    over the fixtures and its interval, with ``per_fixture`` the mean PSNR per fixture over the seeds, as a result
    row's fields; the per-seed means, for paired gains). Identical images score the cap ``ditq compare`` writes for
    them, not infinity."""
    from ditq.judge.compare import PSNR_CAP_DB
    from ditq.judge.stats import mean_interval
    from ditq.metrics import psnr, ssim

    pairs = {
        key: (min(psnr(images[key], against[key]), PSNR_CAP_DB), ssim(images[key], against[key]))
        for key in images
    }
    per_seed = {s: float(np.mean([pairs[f, s][0] for f in fixtures])) for s in seeds}
    interval = mean_interval(list(per_seed.values()))
    fields = {
        "psnr_db": round(float(np.mean([v[0] for v in pairs.values()])), 2),
        "ssim": round(float(np.mean([v[1] for v in pairs.values()])), 4),
        "psnr_db_per_seed": {str(s): round(v, 2) for s, v in per_seed.items()},
        "psnr_db_interval": [round(interval.low, 2), round(interval.high, 2)],
    }
    if per_fixture:
        fields["psnr_db_per_fixture"] = {
            f: round(float(np.mean([pairs[f, s][0] for s in seeds])), 2) for f in fixtures
        }
    return fields, per_seed


def sqnr_db(signal: float, noise: float) -> float:
    """10 log10(signal / noise) in dB to two places (higher is better); +inf without noise."""
    return round(10 * math.log10(signal / noise), 2) if noise > 0 else math.inf


def paired_change(ours: dict[int, float], base: dict[int, float]) -> dict[str, Any]:
    """The mean per-seed PSNR change of ``ours`` over ``base`` (seed by seed) with its interval, as a result row's
    field."""
    from ditq.judge.stats import difference_interval

    change = difference_interval(ours, base)
    return {
        "estimate": round(change.estimate, 2),
        "interval": [round(change.low, 2), round(change.high, 2)],
        "method": change.method,
    }


def write_result(script: str, args: argparse.Namespace, fields: dict[str, Any]) -> None:
    """``args.out``: the command (``--out`` relative to the working directory where it lies inside it), ``fields``
    and the software it ran on."""
    out = args.out
    payload = {
        "command": f"python benchmarks/{script} --seeds {args.seeds} --out {shown_path(out)}",
        **fields,
        "torch": torch.__version__,
        "platform": platform.machine(),
        "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=1) + "\n")


def _images(adapter, requests) -> dict[tuple[str, int], np.ndarray]:  # type: ignore[no-untyped-def]
    return {key: np.asarray(adapter(request).images[0].convert("RGBA")) for key, request in requests.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default=SEEDS, help="the judged seeds (default %(default)s)")
    parser.add_argument("--out", type=Path, default=result_path("four_bit_fidelity", "cpu"))
    args = parser.parse_args()
    from ditq.probe.fixtures import parse_seeds

    seeds = tuple(parse_seeds(args.seeds))

    from ditq.schemes import CHANNEL, get_scheme

    requests = demo_requests(seeds)
    fixtures = list(dict.fromkeys(fixture_id for fixture_id, _ in requests))  # in the fixtures file's order
    started = time.time()
    reference = _images(_adapter(None, "rtn"), requests)
    rows: dict[str, dict] = {}  # type: ignore[type-arg]
    per_seed: dict[str, dict[int, float]] = {}
    for name, (scheme, calibrate, group_size) in ROWS.items():
        begun = time.time()
        images = _images(_adapter(scheme, calibrate, group_size=group_size), requests)
        scores, per_seed[name] = fidelity_scores(images, reference, fixtures, seeds, per_fixture=True)
        rows[name] = {
            "scheme": scheme,
            "calibrate": calibrate,
            # the scales every target of the demo gets (its in_features, 256 or 768, are multiples of 128)
            "group_size": get_scheme(scheme, group_size).group_size or CHANNEL,
            **scores,
            "seconds": round(time.time() - begun, 1),
        }
        print(f"{name:<18} PSNR {rows[name]['psnr_db']:6.2f} dB {rows[name]['psnr_db_interval']}", flush=True)
    for name, row in rows.items():
        if row["calibrate"].startswith("gptq"):  # against the same scheme and scales rounded to nearest
            (rtn,) = (n for n, r in ROWS.items() if r == (row["scheme"], "rtn", ROWS[name][2]))
            gain = paired_change(per_seed[name], per_seed[rtn])
            row["gain_over_rtn_db"] = {"against": rtn, **gain, "at_least_3_db": gain["interval"][0] >= 3.0}
            print(f"{name}: {row['gain_over_rtn_db']}")
        # what one scale per row costs: against the same rounding in groups of 128
        if ROWS[name][2] == CHANNEL:
            (grouped,) = (n for n, r in ROWS.items() if r == (row["scheme"], row["calibrate"], None))
            row["change_over_groups_db"] = {
                "against": grouped,
                **paired_change(per_seed[name], per_seed[grouped]),
            }
            print(f"{name}: {row['change_over_groups_db']}")
    write_result(
        "four_bit_fidelity.py",
        args,
        {
            "what": "demo model, transformer quantized in memory; PSNR/SSIM against the unquantized float32 run",
            "steps": STEPS,
            "seeds": list(seeds),
            "calibration_seeds": list(CALIBRATION_SEEDS),
            "fixtures": list(fixtures),
            "rows": rows,
            "total_seconds": round(time.time() - started, 1),
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
