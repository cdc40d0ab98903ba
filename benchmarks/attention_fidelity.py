"""Quantized attention's fidelity on the demo model, against its parity band.

    python benchmarks/attention_fidelity.py --out benchmarks/results/attention_fidelity_cpu_COMMIT.json

Every fixture of the demo (``ditq.demo`` fixtures, its references), seeds 2301-2302, 8 steps, on the CPU, in
process: the float32 run with the model's own attention is the reference (as the demo's baseline is); against
it, PSNR and SSIM per fixture of

- ``bf16``: the same model in bfloat16, stock attention: the parity band's pair (two acceptable BF16-class runs;
  ``benchmarks/results/demo_parity_cpu_e3f7737.json`` measures it over HTTP at 54.2 dB);
- ``fp32+int8`` / ``fp32+fp8``: float32 with quantized attention (only the attention's error);
- ``bf16+int8`` / ``bf16+fp8``: bfloat16 with quantized attention (what a GPU runs);
- ``fp32+int8-fp8`` / ``bf16+int8-fp8``: the same with int8 Q . K^T and e4m3 P . V.

A quantized run is inside the band when its overall mean PSNR is at least the bf16 run's; the JSON says by how
much each is above or below. Images compared as ``ditq compare`` does (RGBA when both carry alpha).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
from result_names import result_path

SEEDS = (2301, 2302)
STEPS = 8
RUNS = {  # name -> (dtype, attention kind or None)
    "fp32": (torch.float32, None),
    "bf16": (torch.bfloat16, None),
    "fp32+int8": (torch.float32, "int8"),
    "fp32+fp8": (torch.float32, "fp8"),
    "bf16+int8": (torch.bfloat16, "int8"),
    "bf16+fp8": (torch.bfloat16, "fp8"),
    "fp32+int8-fp8": (torch.float32, "int8-fp8"),
    "bf16+int8-fp8": (torch.bfloat16, "int8-fp8"),
}


def _images(dtype: torch.dtype, kind: str | None, fixtures: dict) -> dict[tuple[str, int], np.ndarray]:  # type: ignore[type-arg]
    from ditq.demo import load_demo_pipeline
    from ditq.demo.fixtures import reference_image
    from ditq.doctor.attention import attention_chooser
    from ditq.runtime.adapter import GenerationRequest, PipelineAdapter
    from ditq.runtime.attention import install_attention

    pipeline = load_demo_pipeline(dtype=dtype)
    pipeline.set_progress_bar_config(disable=True)
    if kind is not None:
        install_attention(pipeline, kind, attention_chooser(kind, torch.device("cpu"), dtype))
    adapter = PipelineAdapter(pipeline)
    out = {}
    for fixture_id, fixture in fixtures.items():
        for seed in SEEDS:
            request = GenerationRequest(
                prompt=fixture["prompt"],
                negative_prompt=fixture.get("negative_prompt"),
                images=[reference_image(r) for r in fixture["references"]],
                width=fixture["width"],
                height=fixture["height"],
                num_inference_steps=STEPS,
                seed=seed,
            )
            image = adapter(request).images[0]
            out[fixture_id, seed] = np.asarray(image.convert("RGBA"))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=result_path("attention_fidelity", "cpu"))
    args = parser.parse_args()

    from ditq.demo import fixtures_path
    from ditq.metrics import psnr, ssim

    fixtures = json.loads(fixtures_path().read_text())
    started = time.time()
    images, seconds = {}, {}
    for name, (dtype, kind) in RUNS.items():
        begun = time.time()
        images[name] = _images(dtype, kind, fixtures)
        seconds[name] = round(time.time() - begun, 1)
        print(f"{name}: {seconds[name]} s", flush=True)
    reference = images["fp32"]
    results: dict[str, object] = {}
    for name in RUNS:
        if name == "fp32":
            continue
        per_fixture = {}
        for fixture_id in fixtures:
            pairs = [(images[name][fixture_id, s], reference[fixture_id, s]) for s in SEEDS]
            per_fixture[fixture_id] = {
                "psnr_db": round(float(np.mean([psnr(a, b) for a, b in pairs])), 2),
                "ssim": round(float(np.mean([ssim(a, b) for a, b in pairs])), 4),
            }
        results[name] = {
            "psnr_db": round(float(np.mean([f["psnr_db"] for f in per_fixture.values()])), 2),
            "ssim": round(float(np.mean([f["ssim"] for f in per_fixture.values()])), 4),
            "per_fixture": per_fixture,
        }
    band = results["bf16"]["psnr_db"]  # type: ignore[index]
    for name, result in results.items():
        if "+" in name:
            result["above_band_db"] = round(result["psnr_db"] - band, 2)  # type: ignore[index, operator]
            result["inside_band"] = result["psnr_db"] >= band  # type: ignore[index, operator]
    payload = {
        "command": "python benchmarks/attention_fidelity.py --out " + str(args.out),
        "what": "PSNR/SSIM of the demo model with quantized attention against its float32 run; bf16 is the band",
        "reference_run": "fp32",
        "band_run": "bf16",
        "band_psnr_db": band,
        "steps": STEPS,
        "seeds": list(SEEDS),
        "fixtures": list(fixtures),
        "results": results,
        "seconds": seconds,
        "total_seconds": round(time.time() - started, 1),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=1) + "\n")
    for name, result in results.items():
        extra = f"  {result['above_band_db']:+.2f} dB vs band" if "above_band_db" in result else "  (band)"  # type: ignore[operator]
        print(f"{name:<10} PSNR {result['psnr_db']:6.2f} dB  SSIM {result['ssim']:.4f}{extra}")  # type: ignore[index]
    return 0


if __name__ == "__main__":
    sys.exit(main())
