"""The text encoder's share of a request, eager and compiled, BF16 and 8-bit: what ``--compile`` saves there.

    python benchmarks/text_encoder_bench.py --model MODEL --out FILE [--schemes bf16,fp8,w8a8] [--repeats 5]

A served request encodes its prompt (and its references, through the vision tower) once; at a few hundred tokens
an 8-bit layer's eager host time, its activation quantization and GEMM launched op by op, exceeds its device time,
and the quantized encoder ran slower than BF16's. For each scheme (``bf16``: the model's own encoder; a scheme: the
encoder quantized in memory with ``ditq.quantize_``, each geometry's kernel the registry's first, as the loader
chooses without a doctor), this times the pipeline's own ``encode_prompt`` on each fixture (its prompt, its
references resized as the pipeline resizes them), eager and then compiled by
``ditq.runtime.compile.compile_text_encoder`` (the language model's decoder layers, as ``--compile`` compiles
them): the first call (eager: its
warm-up; compiled: its compilation) and the median of the calls after it, wall time with the device synchronised.
It also counts the graphs compiled once every fixture had run once (0: no request would compile).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_dimensions
from PIL import Image

import ditq
from ditq.fsutil import atomic_write_json
from ditq.probe.fixtures import load_fixtures
from ditq.runtime.compile import compile_text_encoder, compiled_graphs

RESOLUTION = 1024  # the pipeline's output_resolution: references are resized to this many pixels squared


def references(pipeline: Any, paths: list[Path]) -> list[Image.Image] | None:
    """The fixture's references as the pipeline hands them to ``encode_prompt``."""
    resized = []
    for path in paths:
        image = Image.open(path).convert("RGBA")
        width, height, _ = calculate_dimensions(RESOLUTION * RESOLUTION, image.width / image.height)
        resized.append(pipeline.image_processor.resize(image, width=width, height=height))
    return resized or None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(pipeline: Any, prompt: str, images: list[Image.Image] | None, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        pipeline.encode_prompt(prompt, image=images, device=device)
    _sync(device)
    return (time.perf_counter() - start) * 1e3


def measure(
    pipeline: Any, cases: dict[str, tuple[str, Any]], repeats: int, device: torch.device
) -> dict[str, Any]:
    """Fixture -> first call and the median of ``repeats`` after it (ms), every fixture's first call first; and
    ``graphs_after_first_calls``, the graphs compiled once each had run once."""
    first = {name: timed_ms(pipeline, prompt, images, device) for name, (prompt, images) in cases.items()}
    graphs = compiled_graphs()
    rows = {}
    for name, (prompt, images) in cases.items():
        runs = [timed_ms(pipeline, prompt, images, device) for _ in range(repeats)]
        rows[name] = {
            "first_ms": round(first[name], 2),
            "median_ms": round(statistics.median(runs), 2),
            "runs_ms": [round(r, 2) for r in runs],
        }
    return {"fixtures": rows, "graphs_after_first_calls": compiled_graphs() - graphs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="the full-size pipeline's directory")
    parser.add_argument("--fixtures", type=Path, help="default: MODEL/fixtures/fixtures.json")
    parser.add_argument("--refs", type=Path, help="default: MODEL/fixtures/refs")
    parser.add_argument("--schemes", default="bf16,fp8,w8a8")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = torch.device(args.device)
    fixtures = load_fixtures(
        args.fixtures or args.model / "fixtures" / "fixtures.json",
        args.refs or args.model / "fixtures" / "refs",
    )
    pipeline = ditq.load_pipeline(args.model, device=device)
    cases = {
        name: (f.prompt, references(pipeline, [Path(p) for p in f.reference_paths]))
        for name, f in fixtures.items()
    }
    results: dict[str, Any] = {}

    def write() -> None:  # after each scheme: a run cut short keeps the schemes it finished
        atomic_write_json(
            args.out,
            {
                "command": "python benchmarks/text_encoder_bench.py --model MODEL --out FILE "
                f"--schemes {args.schemes} --repeats {args.repeats} --backend {args.backend}",
                "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                "torch": torch.__version__,
                "fixtures": {name: len(f.references) for name, f in fixtures.items()},
                "fields": {
                    "first_ms": "the first call at the fixture: eager, its warm-up; compiled, its compilation",
                    "median_ms": "median of the calls after it (wall, device synchronised)",
                    "graphs_after_first_calls": "graphs compiled once each fixture had run once",
                },
                "results": results,
            },
        )

    for scheme in args.schemes.split(","):
        torch._dynamo.reset()
        if scheme == "bf16":
            encoder = pipeline.text_encoder
        else:
            pipeline.text_encoder = None
            torch.cuda.empty_cache()
            encoder = ditq.load_component(args.model, "text_encoder", device=device)
            ditq.quantize_(encoder, scheme, device=device)
            pipeline.text_encoder = encoder
        eager = measure(pipeline, cases, args.repeats, device)
        begun = time.perf_counter()
        how = compile_text_encoder(encoder, args.backend)
        compiled = measure(pipeline, cases, args.repeats, device)
        results[scheme] = {"eager": eager, "compiled": compiled, "compiled_how": how}
        print(
            f"{scheme}: compiled {how}; first calls and medians ({time.perf_counter() - begun:.1f} s compiled)"
        )
        for name in cases:
            e, c = eager["fixtures"][name], compiled["fixtures"][name]
            print(
                f"  {name:14s} eager {e['median_ms']:8.2f} ms (first {e['first_ms']:8.2f}), compiled "
                f"{c['median_ms']:8.2f} ms (first {c['first_ms']:9.2f}): {c['median_ms'] / e['median_ms']:.3f}x"
            )
        print(f"  graphs after every fixture's first call: {compiled['graphs_after_first_calls']}")
        write()


if __name__ == "__main__":
    main()
